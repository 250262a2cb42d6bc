"""Small hand-built plans for the transition tests."""

from __future__ import annotations

from dataclasses import replace

from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.cluster import CLUSTER_PRESETS, ClusterSpec
from nereus_lightning.spec.workload import Workload
from nereus_lightning.transition import Node, TransitionDAG
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


def lanes(dag: TransitionDAG) -> list[Node]:
    """Every replica-level node of ``dag`` (batched nodes split into their lanes), in order."""
    return [lane for n in dag.nodes for lane in n.lanes()]


def with_nodes(dag: TransitionDAG, *nodes: Node) -> TransitionDAG:
    """``dag`` with other nodes (the context kept): a DAG a test has broken on purpose."""
    return replace(dag, nodes=tuple(nodes))


def without_resource_edges(dag: TransitionDAG) -> TransitionDAG:
    """``dag`` with every resource edge taken out of the deps."""
    return with_nodes(
        dag, *(n._replace(deps=tuple(d for d in n.deps if d not in n.resource_deps)) for n in dag.nodes)
    )
