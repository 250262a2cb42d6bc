"""What bounds writing a 0.5B training unit's state at the end of ``fit``: disk, staging, DCP.

Tensors shaped like Qwen2-0.5B's fp32 masters and two AdamW moments (~5.9 GB) on the GPU. Prints,
one line each: the disk's own write rate (threads writing raw bytes, fsync'd); staging the state in
host memory (allocate, copy from the device, free) in pinned and in pageable memory; ``dcp.save``
(no process group) from the device and from the staged copies, by thread count and with torch's zip
CRC32 on and off; DCP's own ``DefaultStager`` and a :class:`~nereus_lightning.emu.host.HostBlock`
(what ``emu.dcp_state`` stages resident units with), each with a write from it; and, in child
processes, the pinned staging with ``PYTORCH_CUDA_ALLOC_CONF`` pinning through ``cudaHostRegister``
from several threads, and the cost at process exit of holding pinned memory (a HostBlock's too).

    python benchmarks/gpu_dcp_write.py --dir /tmp/dcp [--staging-only]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

HOST_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def state(device: str) -> dict[str, torch.Tensor]:
    """Qwen2-0.5B-shaped fp32 tensors, three per weight (masters, exp_avg, exp_avg_sq)."""
    shapes = [(151936, 896)] + [(896, 896), (128, 896), (128, 896), (896, 896)] * 24
    shapes += [(4864, 896), (4864, 896), (896, 4864)] * 24
    return {
        f"{key}/{i}": torch.randn(shape, device=device)
        for i, shape in enumerate(shapes)
        for key in ("param", "exp_avg", "exp_avg_sq")
    }


def gigabytes(tensors: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9


def report(what: str, gb: float, seconds: float) -> None:
    print(f"{what:52s} {gb:5.2f} GB in {seconds:6.2f} s ({gb / seconds:5.2f} GB/s)", flush=True)


def disk(directory: str, gb: float, threads: int) -> None:
    """Raw bytes from memory to ``threads`` files, each fsync'd: the disk's ceiling for the same bytes."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    chunk = bytes(64 << 20)
    per_thread = int(gb * 1e9 / threads / len(chunk)) + 1

    def write(i: int) -> None:
        with open(os.path.join(directory, f"{i}.bin"), "wb", buffering=0) as f:
            for _ in range(per_thread):
                f.write(chunk)
            os.fsync(f.fileno())

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(threads)))
    written = per_thread * threads * len(chunk) / 1e9
    report(f"disk, raw bytes, {threads} threads", written, time.perf_counter() - start)


def stage(tensors: dict[str, torch.Tensor], pinned: bool, label: str) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors``: time to allocate and to copy, printed."""
    gb = gigabytes(tensors)
    start = time.perf_counter()
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for k, t in tensors.items()}
    allocated = time.perf_counter()
    for k, t in tensors.items():
        host[k].copy_(t, non_blocking=pinned)
    torch.cuda.synchronize()
    report(f"stage {label}: allocate", gb, allocated - start)
    report(f"stage {label}: copy from the device", gb, time.perf_counter() - allocated)
    return host


def free(host: dict[str, torch.Tensor], label: str) -> None:
    gb = gigabytes(host)
    start = time.perf_counter()
    host.clear()
    gc.collect()
    torch._C._host_emptyCache()  # pinned blocks go back to the driver here, not at exit
    report(f"stage {label}: free", gb, time.perf_counter() - start)


def stage_with_dcp(tensors: dict[str, torch.Tensor], directory: str) -> None:
    """DCP's own stager (``cudaHostRegister`` on plain host memory), a write from it, and its release."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gb = gigabytes(tensors)
    start = time.perf_counter()
    options = StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
    )
    stager = DefaultStager(options)
    host = stager.stage(tensors)
    report("stage DCP DefaultStager: allocate, register, copy", gb, time.perf_counter() - start)
    write(host, directory, 8, True, "from DCP's stager")
    start = time.perf_counter()
    stager.close()
    del host
    gc.collect()
    report("stage DCP DefaultStager: release", gb, time.perf_counter() - start)


def stage_with_block(tensors: dict[str, torch.Tensor], directory: str) -> None:
    """What ``emu.dcp_state`` stages with: one HostBlock (pages touched, one cudaHostRegister), a write
    from it, its release.
    """
    from nereus_lightning.emu.host import HostBlock

    gb = gigabytes(tensors)
    start = time.perf_counter()
    block = HostBlock(list(tensors.values()), pin=True)
    allocated = time.perf_counter()
    for host, tensor in zip(block.tensors, tensors.values(), strict=True):
        host.copy_(tensor, non_blocking=True)
    torch.cuda.synchronize()
    report("stage HostBlock: allocate, touch, register", gb, allocated - start)
    report("stage HostBlock: copy from the device", gb, time.perf_counter() - allocated)
    write(dict(zip(tensors, block.tensors, strict=True)), directory, 16, True, "from a HostBlock")
    start = time.perf_counter()
    block.release()
    report("stage HostBlock: release (unregister)", gb, time.perf_counter() - start)


def write(tensors: dict[str, torch.Tensor], directory: str, threads: int, crc: bool, label: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    torch.serialization.set_crc32_options(crc)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dcp.save(tensors, storage_writer=FileSystemWriter(directory, thread_count=threads), no_dist=True)
    report(
        f"dcp {label}, {threads} threads, crc32 {'on' if crc else 'off'}",
        gigabytes(tensors),
        time.perf_counter() - start,
    )
    torch.serialization.set_crc32_options(True)


def exits(directory: str, gb: float, children: list[tuple[str, str]]) -> None:
    """Per (PYTORCH_CUDA_ALLOC_CONF, what the child keeps): the time its process takes to exit."""
    for conf, then in children:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        child = [sys.executable, __file__, "--pinning-child", then, "--dir", directory]
        out = subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
        exited = time.time()
        print(out.rsplit("child done", 1)[0], end="")
        done = float(out.rsplit("child done", 1)[1])
        held = "none" if then == "free" else f"{gb:.2f} GB"
        kind = "HostBlock" if then == "block" else conf or "cudaHostAlloc"
        print(f"process exit, pinned memory held: {held} ({kind}): {exited - done:.2f} s", flush=True)


def main() -> None:
    """Each variant once, after a warm-up write of the same bytes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/dcp")
    parser.add_argument(
        "--pinning-child", choices=["free", "keep", "block"], help="the pinned staging only (a child)"
    )
    parser.add_argument(
        "--staging-only", action="store_true", help="the disk, DCP's stager and a HostBlock only"
    )
    args = parser.parse_args()
    tensors = state("cuda")
    gb = gigabytes(tensors)
    if args.pinning_child == "block":
        from nereus_lightning.emu.host import HostBlock

        held = HostBlock(list(tensors.values()), pin=True)
        print(f"child done {time.time()}", flush=True)
        os._exit(0 if held.pinned else 1)  # as nereus-train leaves: no interpreter teardown
    if args.pinning_child:
        label = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "cudaHostAlloc"
        host = stage(tensors, True, f"pinned, {label}")
        if args.pinning_child == "free":
            free(host, f"pinned, {label}")
        print(f"child done {time.time()}", flush=True)  # the parent times the interpreter's exit from here
        return
    if args.staging_only:
        write(tensors, args.dir, 8, True, "from the device (warm-up)")
        disk(args.dir, gb, 16)
        stage_with_dcp(tensors, args.dir)
        stage_with_block(tensors, args.dir)
        del tensors
        torch.cuda.empty_cache()
        exits(args.dir, gb, [("", "block")])
        return
    disk(args.dir, gb, 8)  # warm-up: the filesystem's first big write
    for threads in (1, 8, 16):
        disk(args.dir, gb, threads)
    write(tensors, args.dir, 8, True, "from the device")
    stage_with_dcp(tensors, args.dir)
    for pinned in (True, False):
        label = "pinned" if pinned else "pageable"
        host = stage(tensors, pinned, label)
        for threads, crc in ((1, True), (8, True), (8, False), (16, False)):
            write(host, args.dir, threads, crc, f"from {label}")
        free(host, label)
    del tensors
    gc.collect()
    torch.cuda.empty_cache()
    exits(args.dir, gb, [("", "keep"), (HOST_REGISTER, "free"), (HOST_REGISTER, "keep"), ("", "block")])
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
