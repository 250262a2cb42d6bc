"""More than one machine: torchrun with 2 simulated nodes, resume on 1 node, the launch check, the node
inventory.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nereus_lightning.cli import train
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.testing.pool import free_port
from tests.helpers import is_launch_variable, launch_env, nereus_train

# GRPO on the embedded default, answers kept at their first length (the first plan stays feasible).
SHORT = (
    "algorithm=grpo",
    "trainer.max_steps=6",
    "checkpoint_every=5",
    "plot=false",
    "export_hf=false",
    "task.grow_every=1000",
)
LOSSES = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/score/mean")  # PPO's


def _torchrun_two_nodes(out: Path, *overrides: str) -> str:
    """Two torchrun agents on this host, one per simulated node, 2 gloo processes each; node 0's output."""
    port = free_port()
    logs = [out.parent / f"{out.name}.node{r}.log" for r in (0, 1)]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=2",
                f"--node-rank={r}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "nereus_lightning.cli.train",
                f"hydra.run.dir={out}",
                "trainer.num_nodes=2",
                "trainer.devices=2",
                *overrides,
            ],
            env=launch_env(),
            stdout=open(logs[r], "w"),
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    codes = [a.wait(timeout=400) for a in agents]
    text = logs[0].read_text()
    assert codes == [0, 0], text[-3000:] + logs[1].read_text()[-2000:]
    return text


def _rows(out: Path) -> dict[int, dict[str, str]]:
    rows = csv.DictReader(open(out / "logs" / "version_0" / "metrics.csv"))
    return {int(float(r["step"])): r for r in rows if r.get("critic/score/mean")}


def _ids(ranges: str) -> list[int]:
    out: list[int] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _memory_that_needs_tp(overrides: tuple[str, ...]) -> tuple[float, object]:
    """A per-GPU memory 60 kB above the least with which the job's controller finds a first plan on
    2 nodes x 2, and that plan.

    Found with the controller the run builds (the module's own model specs and workload), so the
    test follows the cost model: that close to the floor the planner must cut model-stages, and the
    assertion on TP groups only means something if it chooses TP somewhere (checked).
    """
    from dataclasses import replace

    from nereus_lightning.control import StepSignals
    from nereus_lightning.lightning.callback import default_controller
    from nereus_lightning.spec.errors import InfeasiblePlanError

    cfg = train.train_config([*overrides, "trainer.num_nodes=2", "trainer.devices=2"])
    module, cluster = train.build_module(cfg), train.job_cluster_preset(cfg)
    assert (cluster.num_nodes, cluster.gpus_per_node) == (2, 2)
    length = float(module.source.max_response_len(0))
    signals = StepSignals(0, length, length, module.source.mean_prompt_len(), gpus=(0, 1, 2, 3))

    def plan(memory: float):  # noqa: ANN202
        controller = default_controller(module, 4, cluster=replace(cluster, gpu_memory=memory))
        try:
            return controller.step(signals).target
        except InfeasiblePlanError:
            return None

    memory = train._threshold(lambda m: plan(m) is not None, 0.0, cluster.gpu_memory) + 60e3
    chosen = plan(memory)
    assert any(c.layout.tp > 1 for _, c in chosen.items()), f"no TP at {memory:.0f} B: {chosen}"
    return memory, chosen


@pytest.mark.distributed
def test_two_nodes_under_torchrun_then_resume_on_one_node(tmp_path):
    # PPO: its four model-stages (a critic beside the actor) cover GRPO's three.
    short = ("algorithm=ppo", *SHORT[1:])
    memory, planned = _memory_that_needs_tp(short)
    overrides = (*short, f"cluster_gpu_memory={memory!r}")
    two = tmp_path / "two_nodes"
    console = _torchrun_two_nodes(two, *overrides)
    assert "topology 2 nodes x 2 GPUs" in console and "4 ranks started by torchrun" in console
    assert console.count("run summary") == 1  # rank 0 alone prints it

    first = json.loads((two / "decisions.jsonl").read_text().splitlines()[0])
    assert first["decision"] == "initial"
    plan = first["target_plan"]
    assert {g for c in plan.values() for g in _ids(c["gpus"])} == {0, 1, 2, 3}  # all 4 ranks
    assert {n: (c["dp"], c["tp"], c["pp"]) for n, c in plan.items()} == {
        n: (c.dp, c.layout.tp, c.layout.pp) for n, c in planned.items()
    }  # the plan of the 2 x 2 topology
    tp_groups = [
        ids[b : b + c["tp"]]
        for c in plan.values()
        if c["tp"] > 1
        for ids in [_ids(c["gpus"])]
        for b in range(0, len(ids), c["tp"])
    ]
    assert tp_groups and all(len({g // 2 for g in group}) == 1 for group in tp_groups), tp_groups

    full = _rows(two)
    assert sorted(full) == [0, 1, 2, 3, 4, 5]
    ckpt = two / "checkpoints" / "step5.ckpt"
    assert (ckpt / "nereus_meta.json").is_file()

    # The checkpoint written by 2 nodes x 2 resumes on 1 node x 4 (Lightning forks the ranks).
    one = tmp_path / "one_node"
    console = nereus_train(one, *overrides, "trainer.devices=4", f"ckpt_path={ckpt}").stdout
    assert "topology 1 node x 4 GPUs" in console
    resumed = _rows(one)
    assert sorted(resumed) == [5]
    for key in LOSSES:
        a, b = float(full[5][key]), float(resumed[5][key])
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)


def test_num_nodes_without_a_launcher_fails_before_training(tmp_path):
    done = nereus_train(tmp_path, "trainer.num_nodes=2", "trainer.devices=2", check=False)
    assert done.returncode == 2, done.stdout[-2000:]
    message = done.stdout
    for part in (
        "trainer.num_nodes=2",
        "trainer.devices=2",
        "no launcher provides 2 nodes",
        "TORCHELASTIC_RUN_ID",
        "SLURM_NTASKS",
        "MASTER_ADDR, MASTER_PORT, NODE_RANK not set",
    ):
        assert part in message, (part, message[-2000:])
    assert "Initializing distributed" not in message and not (tmp_path / "checkpoints").exists()


# ---- the launch check, from the environment each launcher sets (no process started) ----------
TORCHRUN_NODE1 = {
    "TORCHELASTIC_RUN_ID": "x",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
}
SRUN_NODE1 = {
    "SLURM_NTASKS": "8",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NAME": "train",
    "SLURM_NODELIST": "a[1-2]",
}


def _launched(monkeypatch, env: dict[str, str]):  # noqa: ANN202
    from nereus_lightning.lightning.launch import detect_environment, launch_of

    for key in list(os.environ):
        if is_launch_variable(key):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return launch_of(detect_environment())


@pytest.mark.parametrize(
    ("env", "launcher", "nodes", "per_node", "wrong", "hint"),
    [
        (TORCHRUN_NODE1, "torchrun", 2, 2, (1, 4), "LOCAL_WORLD_SIZE=2"),
        (SRUN_NODE1, "SLURM", 2, 4, (1, 8), "SLURM_NTASKS_PER_NODE=4"),
    ],
)
def test_the_launch_decides_nodes_and_processes(monkeypatch, env, launcher, nodes, per_node, wrong, hint):
    from nereus_lightning.lightning.launch import check_launch

    launch = _launched(monkeypatch, env)
    assert (launch.launcher, launch.num_nodes, launch.processes_per_node, launch.node_rank) == (
        launcher,
        nodes,
        per_node,
        1,
    )
    check_launch(launch, nodes, per_node)
    with pytest.raises(NereusConfigError) as err:
        check_launch(launch, *wrong)
    text = str(err.value)
    assert f"trainer.num_nodes={wrong[0]} x trainer.devices={wrong[1]}" in text and hint in text
    assert f"set trainer.num_nodes={nodes} trainer.devices={per_node}" in text


def test_a_trainer_with_more_nodes_than_the_launch_fails_at_construction(monkeypatch):
    import lightning.pytorch as pl

    from nereus_lightning.lightning import NereusStrategy

    _launched(monkeypatch, {})
    with pytest.raises(NereusConfigError, match="no launcher provides 3 nodes"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=3, strategy=NereusStrategy(), logger=False)


# ---- every node's GPUs through the job's ranks: once, then on change --------------------------
class _FakeNode:
    """A node's GPUs as NVML would report them: node 1 loses its GPU 1 at step 3, gets it back at 5."""

    def __init__(self, node: int) -> None:
        self.node = node

    def pool(self, step: int) -> tuple[int, ...]:
        return (0,) if self.node == 1 and 3 <= step < 5 else (0, 1)


def inventory_on_two_nodes(rank: int, world_size: int) -> dict:
    import torch

    from nereus_lightning.control import NodeInventory
    from nereus_lightning.lightning.launch import DistExchange

    node, local = divmod(rank, 2)
    inventory = NodeInventory(local=lambda: _FakeNode(node))
    inventory.attach(DistExchange(torch.device("cpu")), node, local, 2)
    pools = [inventory.pool(step) for step in range(7)]
    return {"pools": pools, "again": inventory.pool(3), "gathers": inventory.gathers}


@pytest.mark.distributed
def test_node_inventory_gathers_once_then_on_change(dist4):
    results = dist4.run(inventory_on_two_nodes)
    every, lost = (0, 1, 2, 3), (0, 1, 2)
    for result in results:  # the same on every rank
        assert result["pools"] == [every, every, every, lost, lost, every, every]
        assert result["again"] == lost  # an earlier step again: no collective, its pool
        assert result["gathers"] == 3  # the first step, the loss, the return


def test_the_strategy_prices_on_the_launch_shape():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from nereus_lightning.lightning import NereusStrategy
    from nereus_lightning.spec import CLUSTER_PRESETS

    env = LightningEnvironment()
    env.set_world_size(16)
    strategy = NereusStrategy(cluster="paper_cluster3", cluster_environment=env)
    strategy.num_nodes = 4
    shape = strategy.topology
    assert (shape.num_nodes, shape.gpus_per_node, shape.num_gpus) == (4, 4, 16)
    assert shape.inter_bw == CLUSTER_PRESETS["paper_cluster3"].inter_bw and shape.spans_nodes((3, 4))
    assert shape.describe().startswith("4 nodes x 4 GPUs (H200 x8 (HDR IB)), 141 GB per GPU")
