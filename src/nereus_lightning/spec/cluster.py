"""`ClusterSpec`: GPUs, memory, FLOP/s and links of the machines a job runs on."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus_lightning.spec.errors import require, unknown_preset

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


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # Table 3 of the paper. Peak FLOP/s are the vendors' dense bf16 numbers per GPU (per GCD for MI250X).
    "paper_cluster1": ClusterSpec(
        "MI250X x8 (Slingshot-11)", 128, 8, 64 * GB, 191.5e12, 1.6e12, 400 * GB, 4 * 25 * GB
    ),
    "paper_cluster2": ClusterSpec(
        "A100-64GB x4 (HDR100)", 64, 4, 64 * GB, 312e12, 1.64e12, 600 * GB, 4 * 12.5 * GB
    ),
    "paper_cluster3": ClusterSpec("H200 x8 (HDR IB)", 8, 8, 141 * GB, 989e12, 4.8e12, 900 * GB, 25 * GB),
    # One 8xH200 node, like the device machines here.
    "h200x8": ClusterSpec("H200 x8 node", 1, 8, 141 * GB, 989e12, 4.8e12, 900 * GB, 25 * GB),
    # A CPU "cluster" for the embedded default and tests: 4 gloo processes on one host.
    "cpu4": ClusterSpec(
        "CPU x4 (gloo)", 1, 4, 4 * GB, 50e9, 20 * GB, 5 * GB, 1 * GB, 50e-6, 100e-6, 0.01, CPU_LAUNCH_S,
        reserved_memory=0.0,
    ),
}


def cluster_preset(name: str) -> ClusterSpec:
    """The preset called ``name``; unknown names list the known ones."""
    if name not in CLUSTER_PRESETS:
        raise unknown_preset("cluster", name, list(CLUSTER_PRESETS))
    return CLUSTER_PRESETS[name]
