"""``cluster=auto``: what this node's GPUs are (torch and NVML), and the cluster spec they make.

The brain prices plans on a :class:`~nereus_lightning.spec.ClusterSpec`; this module fills the
:class:`~nereus_lightning.spec.cluster.DeviceFacts` it is built from (name, memory, links) and,
for a chip the table :data:`~nereus_lightning.spec.cluster.CHIPS` does not know, measures a bf16
GEMM and a device copy (about a second). The launch gives the shape (nodes x GPUs per node).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import replace
from typing import Any

import torch

from nereus_lightning.spec.cluster import (
    ClusterSpec,
    DeviceFacts,
    chip_of,
    cluster_from_devices,
    cluster_preset,
)


def auto_cluster(on_gpus: bool, num_nodes: int, gpus_per_node: int) -> ClusterSpec:
    """The cluster of a job's ranks: this node's GPU when ``on_gpus`` (and CUDA is there), else the
    ``cpu4`` preset; shaped ``num_nodes`` x ``gpus_per_node`` (the launch's)."""
    if not on_gpus or not torch.cuda.is_available():
        return cluster_preset("cpu4").on_nodes(num_nodes, gpus_per_node)
    return cluster_from_devices(probe_device(_local_device()), num_nodes, gpus_per_node)


def _local_device() -> int:
    """This process's GPU: ``LOCAL_RANK`` (set by torchrun, SLURM and Lightning's launchers), else 0."""
    index = int(os.environ.get("LOCAL_RANK", "0"))
    return index if index < torch.cuda.device_count() else 0


@functools.cache
def probe_device(index: int = 0) -> DeviceFacts:
    """What GPU ``index`` reports: torch's name and memory, NVML's links; measured rates for an
    unknown chip (once per process)."""
    props = torch.cuda.get_device_properties(index)
    name = props.name or f"GPU {index}"
    facts = DeviceFacts(name, float(props.total_memory), **_nvml_links(props))
    if chip_of(name) is not None:
        return facts
    device = torch.device("cuda", index)
    return replace(facts, measured_flops=gemm_rate(device), measured_hbm_bw=copy_rate(device))


def _nvml_links(props: Any) -> dict[str, int]:
    """The GPU's active NVLink links and PCIe link as NVML reports them ({} without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
    except Exception:  # no NVML (ROCm, no driver library) or no such device: the chip table's link
        return {}
    links: dict[str, int] = {"nvlinks": 0}
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                links["nvlinks"] += 1
                links["nvlink_version"] = pynvml.nvmlDeviceGetNvLinkVersion(handle, link)
        except pynvml.NVMLError:
            break  # no NVLink, or no more links
    try:
        links["pcie_gen"] = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        links["pcie_width"] = pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
    except pynvml.NVMLError:
        pass
    return links


def _best_rate(work: float, run: Any, device: torch.device, repeats: int = 5) -> float:
    """``work`` divided by the fastest of ``repeats`` timed calls of ``run`` (after one warm-up)."""
    run()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return work / best


def gemm_rate(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of an ``n`` x ``n`` x ``n`` bf16 matmul on ``device``."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return _best_rate(2.0 * n**3, lambda: torch.mm(a, b), device)


def copy_rate(device: torch.device, numel: int = 2**28) -> float:
    """Bytes/s a device-to-device copy of ``numel`` bf16 values reads and writes on ``device``."""
    src = torch.empty(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _best_rate(2.0 * src.nbytes, lambda: dst.copy_(src), device)
