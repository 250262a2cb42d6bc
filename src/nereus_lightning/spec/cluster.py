"""`ClusterSpec`: GPUs, memory, FLOP/s and links of the machines a job runs on."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from nereus_lightning.spec.errors import NereusConfigError, require, unknown_preset

GB = 1e9
#: A CUDA/HIP kernel launch from an eager framework: ~5-10 us of host time each.
GPU_LAUNCH_S = 10e-6
#: An eager PyTorch op on CPU (dispatch, allocation, thread-pool wake-up) before any arithmetic.
CPU_LAUNCH_S = 20e-6
#: GPU memory outside PyTorch's allocator: CUDA context (~0.5 GB), NCCL buffers, cuBLAS workspaces.
GPU_RESERVED_BYTES = 2**30


@dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous nodes of GPUs; bandwidths are bytes/s per direction.

    ``intra_bw`` is one GPU's bandwidth to its node peers (NVLink / Infinity Fabric);
    ``inter_bw`` is one node's total NIC bandwidth, shared by the GPUs of that node that talk
    across nodes at the same time. ``num_gpus`` is the pool in use (GPU ids ``0..num_gpus-1``,
    filling nodes in order); 0 means every GPU of every node. ``launch_s`` is the host-side
    cost of issuing one kernel (launch plus eager framework work): every forward-like pass pays
    it once per kernel, whatever the batch, which is what makes larger micro-batches cheaper.
    ``reserved_memory`` is what a GPU holds outside PyTorch's allocator (the CUDA context, NCCL's
    buffers, cuBLAS workspaces): plans size what the allocator holds under the rest.
    """

    name: str
    num_nodes: int
    gpus_per_node: int
    gpu_memory: float  # bytes
    peak_flops: float  # dense bf16 FLOP/s per GPU
    hbm_bw: float  # bytes/s per GPU
    intra_bw: float
    inter_bw: float
    intra_latency: float = 5e-6  # seconds per message
    inter_latency: float = 10e-6
    comm_setup: float = 0.05  # seconds to create one communicator
    launch_s: float = GPU_LAUNCH_S  # seconds per kernel launched
    num_gpus: int = 0
    reserved_memory: float = GPU_RESERVED_BYTES  # bytes per GPU outside the allocator (0 on CPU ranks)

    def __post_init__(self) -> None:
        for field in (
            "num_nodes",
            "gpus_per_node",
            "gpu_memory",
            "peak_flops",
            "hbm_bw",
            "intra_bw",
            "inter_bw",
        ):
            require(
                getattr(self, field) > 0, f"cluster.{field}", f"must be positive, got {getattr(self, field)}"
            )
        for field in ("intra_latency", "inter_latency", "comm_setup", "launch_s", "reserved_memory"):
            require(
                getattr(self, field) >= 0, f"cluster.{field}", f"must be >= 0, got {getattr(self, field)}"
            )
        total = self.num_nodes * self.gpus_per_node
        if self.num_gpus == 0:
            object.__setattr__(self, "num_gpus", total)
        require(self.num_gpus >= 1, "cluster.num_gpus", f"must be >= 1, got {self.num_gpus}")
        require(
            self.num_gpus <= total,
            "cluster.num_gpus",
            f"{self.num_gpus} exceeds {self.num_nodes} nodes x {self.gpus_per_node} GPUs = {total}; "
            "raise cluster.num_nodes",
        )

    def node_of(self, gpu: int) -> int:
        """The node that holds GPU ``gpu``."""
        return gpu // self.gpus_per_node

    def spans_nodes(self, gpus: tuple[int, ...] | list[int]) -> bool:
        """Whether a GPU group crosses a node boundary (and so uses the inter-node link)."""
        return len({self.node_of(g) for g in gpus}) > 1

    def with_gpus(self, num_gpus: int) -> ClusterSpec:
        """The same machines with a pool of ``num_gpus`` GPUs (nodes grow if needed)."""
        require(num_gpus >= 1, "cluster.num_gpus", f"must be >= 1, got {num_gpus}")
        nodes = max(self.num_nodes, -(-num_gpus // self.gpus_per_node))
        return replace(self, num_nodes=nodes, num_gpus=num_gpus)

    def on_nodes(self, num_nodes: int, gpus_per_node: int) -> ClusterSpec:
        """The same machines (memory, FLOP/s, links) shaped as a launch gives them: ``num_nodes`` x
        ``gpus_per_node``, every GPU in the pool."""
        require(num_nodes >= 1, "trainer.num_nodes", f"must be >= 1, got {num_nodes}")
        require(gpus_per_node >= 1, "trainer.devices", f"must be >= 1 per node, got {gpus_per_node}")
        return replace(self, num_nodes=num_nodes, gpus_per_node=gpus_per_node, num_gpus=0)

    def describe(self) -> str:
        """One line: shape, per-GPU memory and the two links, e.g. for a CLI's topology line."""
        shape = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''} x {self.gpus_per_node} GPUs"
        return (
            f"{shape} ({self.name}), {self.gpu_memory / GB:.4g} GB per GPU, intra-node "
            f"{self.intra_bw / GB:.4g} GB/s per GPU, inter-node {self.inter_bw / GB:.4g} GB/s per node"
        )


@dataclass(frozen=True)
class Chip:
    """One GPU model's vendor numbers: dense bf16 FLOP/s, HBM bandwidth and memory, and the link
    of one GPU to its node peers in an ordinary server of that GPU (NVLink, Infinity Fabric or PCIe).

    ``tokens`` must all appear in the name the device reports (upper case, split at spaces,
    hyphens and slashes): ``("A100", "PCIE", "40GB")`` matches ``"NVIDIA A100-PCIE-40GB"``.
    Link figures are the vendor's per-GPU totals, as the presets give them (H100: 900 GB/s).
    """

    name: str
    tokens: tuple[str, ...]
    peak_flops: float
    hbm_bw: float
    memory: float
    link_bw: float


#: PCIe bandwidth per lane and direction, by generation (bytes/s, after line coding).
PCIE_LANE_BW = {3: 0.985 * GB, 4: 1.969 * GB, 5: 3.938 * GB, 6: 7.563 * GB}
#: One NVLink link's bandwidth, both directions together (the vendors' per-GPU totals add these),
#: by NVLink generation: NVLink 4 on an H100 is 18 links x 50 GB/s = 900 GB/s.
NVLINK_BW = {1: 40 * GB, 2: 50 * GB, 3: 50 * GB, 4: 50 * GB, 5: 100 * GB}
#: A link a detected GPU is priced on when it has no NVLink and NVML gives no PCIe link: PCIe 4 x16.
FALLBACK_LINK_BW = 2 * 16 * PCIE_LANE_BW[4]
#: One node's network bandwidth where nothing says otherwise: one 200 Gb/s NIC (the presets' figure).
DEFAULT_NIC_BW = 25 * GB

#: Known chips, matched by :func:`chip_of` (the entry with the most matching tokens wins).
CHIPS: tuple[Chip, ...] = (
    Chip("H100 SXM", ("H100",), 989e12, 3.35e12, 80 * GB, 900 * GB),
    Chip("H100 PCIe", ("H100", "PCIE"), 756e12, 2.0e12, 80 * GB, 2 * 16 * PCIE_LANE_BW[5]),
    Chip("H100 NVL", ("H100", "NVL"), 835e12, 3.9e12, 94 * GB, 600 * GB),
    Chip("H200", ("H200",), 989e12, 4.8e12, 141 * GB, 900 * GB),
    Chip("H200 NVL", ("H200", "NVL"), 835e12, 4.8e12, 141 * GB, 900 * GB),
    Chip("A100 SXM 80GB", ("A100",), 312e12, 2.039e12, 80 * GB, 600 * GB),
    Chip("A100 SXM 40GB", ("A100", "40GB"), 312e12, 1.555e12, 40 * GB, 600 * GB),
    Chip("A100 PCIe 80GB", ("A100", "PCIE"), 312e12, 1.935e12, 80 * GB, 2 * 16 * PCIE_LANE_BW[4]),
    Chip("A100 PCIe 40GB", ("A100", "PCIE", "40GB"), 312e12, 1.555e12, 40 * GB, 2 * 16 * PCIE_LANE_BW[4]),
    Chip("L40S", ("L40S",), 362e12, 864e9, 48 * GB, 2 * 16 * PCIE_LANE_BW[4]),
    Chip("L4", ("L4",), 121e12, 300e9, 24 * GB, 2 * 16 * PCIE_LANE_BW[4]),
    Chip("B200", ("B200",), 2.25e15, 8.0e12, 180 * GB, 1800 * GB),
    Chip("MI300X", ("MI300X",), 1307e12, 5.3e12, 192 * GB, 896 * GB),
    Chip("MI250X", ("MI250X",), 191.5e12, 1.6e12, 64 * GB, 400 * GB),  # per GCD, as paper_cluster1
)


def _tokens(device_name: str) -> set[str]:
    return set(re.split(r"[\s\-/_]+", device_name.upper()))


def chip_of(device_name: str) -> Chip | None:
    """The known chip a device name reports (e.g. ``"NVIDIA H100 80GB HBM3"``), None if none matches."""
    tokens = _tokens(device_name)
    matches = [chip for chip in CHIPS if set(chip.tokens) <= tokens]
    return max(matches, key=lambda chip: len(chip.tokens), default=None)


@dataclass(frozen=True)
class DeviceFacts:
    """What a node's GPUs report (torch and NVML): the input of ``cluster=auto``.

    The body's probe (``nereus_lightning.lightning.devices``) fills it; the measured rates are
    set only for a chip :func:`chip_of` does not know.
    """

    name: str  # the device's name, e.g. "NVIDIA H100 80GB HBM3"
    memory: float  # bytes per GPU
    nvlinks: int = 0  # active NVLink links of one GPU (0: none, or not reported)
    nvlink_version: int = 0
    pcie_gen: int = 0  # the GPU's PCIe link (0: not reported)
    pcie_width: int = 0
    measured_flops: float = 0.0  # the rate of a large bf16 GEMM on this GPU
    measured_hbm_bw: float = 0.0  # the rate of a device-to-device copy (read + write)

    def link_bw(self, chip: Chip | None) -> float:
        """One GPU's bandwidth to its node peers: its NVLinks, else its PCIe link, else the chip's."""
        if self.nvlinks > 0:
            per_link = NVLINK_BW.get(self.nvlink_version, NVLINK_BW[max(NVLINK_BW)])
            return self.nvlinks * per_link
        if self.pcie_gen in PCIE_LANE_BW and self.pcie_width > 0:
            return 2 * self.pcie_width * PCIE_LANE_BW[self.pcie_gen]
        return chip.link_bw if chip is not None else FALLBACK_LINK_BW


def cluster_from_devices(facts: DeviceFacts, num_nodes: int, gpus_per_node: int) -> ClusterSpec:
    """The cluster of ``num_nodes`` x ``gpus_per_node`` GPUs like the one ``facts`` describes.

    Memory and links are the device's own; FLOP/s and HBM bandwidth come from :data:`CHIPS`, or
    for an unknown chip from the measured rates (a GEMM reaches less than the vendor's peak, so
    such a cluster is priced slower until calibration learns it). The network is one
    :data:`DEFAULT_NIC_BW` NIC per node.
    """
    chip = chip_of(facts.name)
    peak, hbm = (chip.peak_flops, chip.hbm_bw) if chip else (facts.measured_flops, facts.measured_hbm_bw)
    if peak <= 0 or hbm <= 0:
        raise NereusConfigError(
            f"cluster=auto: {facts.name!r} is not a known chip ({', '.join(c.name for c in CHIPS)}) and "
            f"was not measured; set cluster= one of {', '.join(sorted(CLUSTER_PRESETS))}"
        )
    label = facts.name if chip else f"{facts.name}, measured"
    return ClusterSpec(
        label, num_nodes, gpus_per_node, facts.memory, peak, hbm, facts.link_bw(chip), DEFAULT_NIC_BW
    )


def _node_of(chip: Chip, gpus: int = 8) -> ClusterSpec:
    """One ordinary server of ``gpus`` ``chip`` GPUs and one :data:`DEFAULT_NIC_BW` NIC."""
    return ClusterSpec(
        f"{chip.name} x{gpus} node",
        1,
        gpus,
        chip.memory,
        chip.peak_flops,
        chip.hbm_bw,
        chip.link_bw,
        DEFAULT_NIC_BW,
    )


def _chip(name: str) -> Chip:
    return next(chip for chip in CHIPS if chip.name == name)


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # Table 3 of the paper. Peak FLOP/s are the vendors' dense bf16 numbers per GPU (per GCD for MI250X).
    "paper_cluster1": ClusterSpec(
        "MI250X x8 (Slingshot-11)", 128, 8, 64 * GB, 191.5e12, 1.6e12, 400 * GB, 4 * 25 * GB
    ),
    "paper_cluster2": ClusterSpec(
        "A100-64GB x4 (HDR100)", 64, 4, 64 * GB, 312e12, 1.64e12, 600 * GB, 4 * 12.5 * GB
    ),
    "paper_cluster3": ClusterSpec("H200 x8 (HDR IB)", 8, 8, 141 * GB, 989e12, 4.8e12, 900 * GB, 25 * GB),
    # One 8-GPU server of each chip the presets know (the device machines here are H100 and H200 nodes).
    "h100x8": _node_of(_chip("H100 SXM")),
    "h200x8": _node_of(_chip("H200")),
    "a100x8": _node_of(_chip("A100 SXM 80GB")),
    "l40sx8": _node_of(_chip("L40S")),
    "b200x8": _node_of(_chip("B200")),
    "mi300x8": _node_of(_chip("MI300X")),
    # A CPU "cluster" for the embedded default and tests: 4 gloo processes on one host.
    "cpu4": ClusterSpec(
        "CPU x4 (gloo)",
        1,
        4,
        4 * GB,
        50e9,
        20 * GB,
        5 * GB,
        1 * GB,
        50e-6,
        100e-6,
        0.01,
        CPU_LAUNCH_S,
        reserved_memory=0.0,
    ),
}


def cluster_preset(name: str) -> ClusterSpec:
    """The preset called ``name``; unknown names list the known ones."""
    if name not in CLUSTER_PRESETS:
        raise unknown_preset("cluster", name, list(CLUSTER_PRESETS))
    return CLUSTER_PRESETS[name]
