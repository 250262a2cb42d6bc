"""Fail fast across ranks: an exception on one rank stops every rank of the job within seconds, with its
error.

Without this, a rank that raises mid-schedule leaves its peers blocked in a receive or a collective
until the process-group timeout. Inside :func:`fail_together`, an exception on this rank is
published in the job's store (the first failure wins) and this rank's process groups are
aborted, so the peers blocked on it fail at once (gloo: its connections close). A watcher thread
on every rank aborts that rank's groups as soon as the store holds a failure, for backends whose
waiting ranks do not notice a dead peer by themselves (NCCL). A rank whose communication then
fails raises :class:`PeerFailure` naming the failed rank and its error.

Aborting is final: the job stops, as an SPMD job must once one of its ranks is gone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

#: The store key holding the first failure of the job: ``"rank <r>: <error>"``.
FAILURE_KEY = "nereus/failure"
#: How often the watcher looks for a failure (seconds).
POLL_S = 1.0
_BREAK_TAG = 0x6E657275  # a tag no other operation uses

_watcher: threading.Thread | None = None
_store: dist.Store | None = None  # held, so a failing rank 0 keeps serving its store
_seen: str | None = None  # the failure the watcher read before it aborted this rank's groups
_aborting = threading.Lock()  # the watcher and the main thread may both abort; one at a time


class PeerFailure(RuntimeError):
    """Another rank of the job failed and this rank stopped because of it; the message carries its error."""


def _default_store() -> dist.Store:
    global _store
    if _store is None:
        _store = dist.distributed_c10d._get_default_store()
    return _store


def _abort() -> None:
    """Abort every process group of this rank (idempotent; the watcher and the main thread both call it)."""
    with _aborting:
        if dist.is_initialized():
            _break_gloo_pairs()
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()


def _break_gloo_pairs() -> None:
    """Close this rank's gloo connections to every peer, so a peer blocked on one fails at once.

    gloo's abort leaves its connections open; a receive whose wait times out closes the
    connection to that peer, and the peer's pending operations on it then raise "Connection
    closed by peer". NCCL groups are left to the abort.
    """
    import torch

    world = dist.distributed_c10d._world
    for group in list(world.pg_map):
        for peer in _gloo_peers(group):
            with contextlib.suppress(Exception):
                group.recv([torch.empty(0)], peer, _BREAK_TAG).wait(timedelta(milliseconds=1))


def _gloo_peers(group: dist.ProcessGroup) -> list[int]:
    """The other ranks of a gloo group; none for another backend or a group already destroyed."""
    try:
        if dist.get_backend(group) != "gloo":
            return []
        me = dist.get_rank(group)
        return [peer for peer in range(dist.get_world_size(group)) if peer != me]
    except (ValueError, RuntimeError):  # removed from the world map by an abort that ran first
        return []


def _watch(store: dist.Store) -> None:
    global _seen
    while dist.is_initialized():
        try:
            failed = store.check([FAILURE_KEY])
        except Exception:  # the store is gone: the job is over
            return
        if failed:
            # Kept before the abort: the main thread, whose work the abort breaks, may then fail to
            # read the store and must still name the rank that failed first.
            with contextlib.suppress(Exception):
                _seen = store.get(FAILURE_KEY).decode()
            _abort()
            return
        time.sleep(POLL_S)


def _start_watcher() -> None:
    global _watcher
    if _watcher is None:
        # Its own connection: the main thread's store calls must not queue behind the watcher's.
        store = _default_store().clone()  # type: ignore[attr-defined]  # torch's .pyi lacks Store.clone
        _watcher = threading.Thread(target=_watch, args=(store,), name="nereus-fail-fast", daemon=True)
        _watcher.start()


def published_failure() -> str | None:
    """The job's first failure (``"rank <r>: <error>"``), or None."""
    with contextlib.suppress(Exception):
        store = _default_store()
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    return _seen


@contextlib.contextmanager
def fail_together() -> Iterator[None]:
    """Run a block of collective work so that an exception on any rank stops every rank promptly.

    An exception here is published (``rank <r>: <type>: <message>``) and this rank's process groups
    are aborted, then it propagates. A rank whose work fails because another rank failed raises
    :class:`PeerFailure` with that rank's error instead. A no-op without torch.distributed or with one rank.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    rank = dist.get_rank()
    _start_watcher()
    try:
        cause = published_failure()
        if cause is not None:
            raise PeerFailure(f"rank {rank} stopped because {cause}")
        yield
    except PeerFailure:
        _abort()
        raise
    except BaseException as exc:
        cause = published_failure()
        if cause is not None and not cause.startswith(f"rank {rank}:"):
            _abort()
            raise PeerFailure(f"rank {rank} stopped because {cause}") from exc
        with contextlib.suppress(Exception):
            _default_store().compare_set(FAILURE_KEY, "", f"rank {rank}: {type(exc).__name__}: {exc}")
        _abort()
        raise
