"""How fast one process writes a 0.5B model-stage's state with DCP: threads, and from device or host.

Tensors shaped like Qwen2-0.5B's (fp32 masters and two AdamW moments: ~5.9 GB), saved with
``dcp.save`` (no process group) through a ``FileSystemWriter`` of 1 and of 8 threads, from GPU
memory and from pinned host memory. Prints seconds and GB/s for each.

    python benchmarks/gpu_dcp_write.py --dir /tmp/dcp
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter


def state(device: str, pinned: bool) -> dict[str, torch.Tensor]:
    """Qwen2-0.5B-shaped fp32 tensors, three per weight (masters, exp_avg, exp_avg_sq)."""
    shapes = [(151936, 896)] + [(896, 896), (128, 896), (128, 896), (896, 896)] * 24
    shapes += [(4864, 896), (4864, 896), (896, 4864)] * 24
    out = {}
    for i, shape in enumerate(shapes):
        for key in ("param", "exp_avg", "exp_avg_sq"):
            t = torch.randn(shape, device=device)
            out[f"{key}/{i}"] = t.pin_memory() if pinned else t
    return out


def main() -> None:
    """Time each variant once (after a warm-up write)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/dcp")
    args = parser.parse_args()
    for where in ("cuda", "pinned"):
        tensors = state("cpu" if where == "pinned" else "cuda", where == "pinned")
        gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
        for threads in (1, 8, 1):
            shutil.rmtree(args.dir, ignore_errors=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            dcp.save(tensors, storage_writer=FileSystemWriter(args.dir, thread_count=threads), no_dist=True)
            s = time.perf_counter() - start
            print(f"dcp write {where:6s} threads={threads}: {gb:.2f} GB in {s:.2f} s ({gb / s:.2f} GB/s)")
        del tensors
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
