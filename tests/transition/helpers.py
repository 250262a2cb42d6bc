"""Small hand-built plans for the transition tests."""

from __future__ import annotations

from dataclasses import replace

from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.cluster import CLUSTER_PRESETS, ClusterSpec
from nereus_lightning.spec.workload import Workload
from nereus_lightning.transition.scenarios import default_models

MODELS = default_models()
PPO = Workload("ppo")
CLUSTER = CLUSTER_PRESETS["paper_cluster3"]  # 8 nodes x 8 H200, 141 GB


def cand(tp: int, pp: int, gpus: range | tuple[int, ...]) -> Candidate:
    """``len(gpus) / (tp * pp)`` replicas of TP x PP on ``gpus``."""
    gpus = tuple(gpus)
    return Candidate(Layout(tp, pp), len(gpus) // (tp * pp), gpus)


def plan(**stages: Candidate) -> Plan:
    """A plan of the given model-stages, in workflow order."""
    order = [ms.name for ms in PPO.stages]
    return Plan.of({name: stages[name] for name in order if name in stages})


def with_memory(gb: float) -> ClusterSpec:
    """The paper's cluster 3 with ``gb`` GB per GPU."""
    return replace(CLUSTER, gpu_memory=gb * 1e9)


def lanes(dag) -> list:
    """Every replica-level node of ``dag`` (batched nodes split into their lanes), in order."""
    return [lane for n in dag.nodes for lane in n.lanes()]
