"""Where a job's processes come from: the launcher Lightning detects and the topology it reports.

Lightning's cluster environments (``TorchElasticEnvironment`` for torchrun, ``SLURMEnvironment``
for ``srun``, ``LightningEnvironment`` for a plain start) read the ranks from the environment.
Nereus plans on nodes x GPUs per node, so it checks, before any model is built or any process
group formed, that ``trainer.num_nodes`` and ``trainer.devices`` describe the processes the
launcher actually started; a mismatch would otherwise hang in the rendezvous or price links on
a topology the job does not have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from nereus_lightning.spec.errors import NereusConfigError

#: Environment variables a plain (Lightning) multi-node start needs on every node.
PLAIN_MULTINODE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


@dataclass(frozen=True)
class Launch:
    """The job's processes as its launcher reports them (``None``: the launcher does not say).

    Attributes:
        launcher: ``"torchrun"``, ``"SLURM"``, ``"Lightning"`` (started by Lightning itself, or by
            hand with ``LOCAL_RANK`` set), or the cluster environment's class name.
        num_nodes: nodes of the job.
        processes_per_node: processes (one per GPU) on each node.
        world_size: processes of the whole job.
        node_rank: this process's node.
        reported: the environment variables the numbers come from, for messages.
    """

    launcher: str
    num_nodes: int | None
    processes_per_node: int | None
    world_size: int | None
    node_rank: int
    reported: str


def detect_environment() -> ClusterEnvironment:
    """The cluster environment Lightning's Trainer would choose here, in Lightning's order."""
    for env_type in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment):
        if env_type.detect():
            return env_type()
    return LightningEnvironment()


def _variables(*names: str) -> str:
    return ", ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ) or "none of them set"


def launch_of(environment: ClusterEnvironment) -> Launch:
    """What ``environment`` says about the job's nodes and processes per node."""
    if isinstance(environment, TorchElasticEnvironment):
        world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        return Launch(
            "torchrun",
            world // per_node,
            per_node,
            world,
            environment.node_rank(),
            _variables("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
        )
    if isinstance(environment, SLURMEnvironment):
        tasks = int(os.environ["SLURM_NTASKS"])
        nodes = int(os.environ.get("SLURM_NNODES", os.environ.get("SLURM_JOB_NUM_NODES", "1")))
        reported = _variables("SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")
        if tasks % nodes:
            raise NereusConfigError(
                f"trainer.devices: SLURM placed {tasks} tasks on {nodes} nodes ({reported}); Nereus needs "
                "the same number on every node: srun --ntasks-per-node=<GPUs per node>"
            )
        return Launch("SLURM", nodes, tasks // nodes, tasks, environment.node_rank(), reported)
    if isinstance(environment, LightningEnvironment):
        node_rank = environment.node_rank()
        if environment.creates_processes_externally and "WORLD_SIZE" in os.environ:
            # Processes started by hand: the world is known, the split into nodes is not.
            world, reported = (
                int(os.environ["WORLD_SIZE"]),
                _variables("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"),
            )
            return Launch("Lightning", None, None, world, node_rank, reported)
        return Launch("Lightning", None, None, None, node_rank, _variables(*PLAIN_MULTINODE_VARIABLES))
    world = environment.world_size()
    return Launch(
        type(environment).__name__, None, None, world, environment.node_rank(), f"world size {world}"
    )


def check_launch(launch: Launch, num_nodes: int, devices: int) -> None:
    """Refuse a ``trainer.num_nodes`` x ``trainer.devices`` that is not the job ``launch`` started.

    Raises:
        NereusConfigError: naming both keys, what the launcher reported and the settings that match.
    """
    asked = f"trainer.num_nodes={num_nodes} x trainer.devices={devices} ({num_nodes * devices} ranks)"
    if launch.num_nodes is not None:
        if (launch.num_nodes, launch.processes_per_node) != (num_nodes, devices):
            raise NereusConfigError(
                f"{asked} is not the job {launch.launcher} started: {launch.num_nodes} node(s) x "
                f"{launch.processes_per_node} processes ({launch.reported}); set "
                f"trainer.num_nodes={launch.num_nodes} trainer.devices={launch.processes_per_node}"
            )
        return
    if launch.world_size is not None:
        if launch.world_size != num_nodes * devices:
            raise NereusConfigError(
                f"{asked} is not the job {launch.launcher} started: {launch.world_size} processes "
                f"({launch.reported})"
            )
        return
    if num_nodes == 1:
        return
    missing = [n for n in PLAIN_MULTINODE_VARIABLES if n not in os.environ]
    if missing:
        raise NereusConfigError(
            f"{asked}: no launcher provides {num_nodes} nodes. This process was not started by torchrun "
            f"(no TORCHELASTIC_RUN_ID) or srun (no SLURM_NTASKS), and a plain start on every node needs "
            f"{', '.join(PLAIN_MULTINODE_VARIABLES)} ({', '.join(missing)} not set). Start one nereus-train "
            f"per node under torchrun --nnodes={num_nodes} --nproc-per-node={devices} or srun "
            f"--nodes={num_nodes} --ntasks-per-node={devices} (README: 'More than one machine'), "
            "or set trainer.num_nodes=1"
        )
    if not 0 <= launch.node_rank < num_nodes:
        raise NereusConfigError(
            f"{asked}: NODE_RANK={launch.node_rank} is not a node of the job (0..{num_nodes - 1})"
        )


class DistExchange:
    """The two collectives a :class:`~nereus_lightning.control.NodeInventory` needs, over the default group.

    Args:
        device: where the one-flag reduction's tensor lives (the rank's device: NCCL needs a GPU tensor).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (the same answer on every rank)."""
        box = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` in rank order, on every rank."""
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
