"""Where the training stage waits for the GPU: bench_gpu_e2e's run with its last training stage under a
dispatch mode that counts the Python stacks of ``item()``, ``nonzero`` and device-to-host copies.

Takes bench_gpu_e2e's arguments, e.g. ``python benchmarks/find_syncs.py --system nereus --shape 0.5b
--new-tokens 256 --steps 2 --warmup 1 --tag sync``; the stacks go to ``<out>/profile_<shape>_n<N>.syncs.txt``.
"""

from __future__ import annotations

import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
import bench_gpu_e2e  # noqa: E402


def _waits(func, args: tuple, kwargs: dict) -> bool:  # noqa: ANN001
    """Whether ``func`` makes the host wait for the GPU (a scalar read, nonzero, a copy to the host)."""
    if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
        return True
    if func is torch.ops.aten._to_copy.default:
        return kwargs.get("device") == torch.device("cpu") and args[0].is_cuda
    if func is torch.ops.aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].is_cuda
    return func is torch.ops.aten.repeat_interleave.Tensor and args[0].is_cuda


def _where() -> tuple[str, ...]:
    """The caller's last five frames outside this file and the dispatch machinery."""
    skipped = ("_python_dispatch", "_dynamo", "_compile.py")
    frames = [f for f in traceback.extract_stack() if not any(s in f.filename for s in skipped)][:-2]
    return tuple(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}:{f.name}" for f in frames[-5:])


class SyncFinder(TorchDispatchMode):
    """Counts each waiting op by (op, caller stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if _waits(func, args, kwargs):
            self.stacks[(str(func), _where())] += 1
        return func(*args, **kwargs)


def sync_counts(path: Path):  # noqa: ANN201
    """A ``measure`` for ``bench_gpu_e2e.on_last_call``: the call under :class:`SyncFinder`, its counts
    written beside ``path``."""

    def measure(call):  # noqa: ANN001, ANN202
        finder = SyncFinder()
        with finder:
            out = call()
        counts = finder.stacks.most_common(60)
        lines = [f"{n} {op} " + " <- ".join(reversed(stack)) for (op, stack), n in counts]
        path.with_suffix(".syncs.txt").write_text("\n".join(lines) + "\n")
        return out

    return measure


if __name__ == "__main__":
    bench_gpu_e2e.main([*sys.argv[1:], "--profile"], profiler=sync_counts)
