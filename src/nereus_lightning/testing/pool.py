"""`WorkerPool`: N processes that join one gloo process group once and then run many functions.

Spawning and rendezvous cost seconds per process on a small machine, so tests reuse one pool
(and one default process group) across test cases. Functions must be importable by reference
(module-level); each runs on every rank as ``fn(rank, world_size, *args)`` and the pool returns
the per-rank results in rank order. A failure on any rank raises :class:`WorkerError` carrying
every failing rank's traceback; the pool stays usable.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A function raised on one or more ranks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    # A short collective timeout: a rank that raised must not leave the others blocked for 30 minutes.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=float(env.get("NEREUS_PG_TIMEOUT", "120"))),
    )
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # report, keep serving
            outbox.put((rank, False, traceback.format_exc()))
    if dist.is_initialized():  # a failure may have aborted the groups (models.fail_fast)
        dist.destroy_process_group()


class WorkerPool:
    """A fixed pool of ``world_size`` gloo ranks on this host."""

    def __init__(self, world_size: int, timeout: float = 300.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        env = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "MASTER_ADDR": "127.0.0.1",
            "NEREUS_PG_TIMEOUT": os.environ.get("NEREUS_PG_TIMEOUT", "120"),
        }
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, port, self._inboxes[r], self._outbox, env), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results in rank order."""
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._outbox.get(timeout=self.timeout)
            except Exception as exc:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise WorkerError(f"no answer within {self.timeout}s (dead ranks: {dead})") from exc
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise WorkerError("\n".join(errors))
        return results

    def close(self) -> None:
        """Stop the workers."""
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
