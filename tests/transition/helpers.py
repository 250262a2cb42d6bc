"""The transition tests' models, workload and cluster, and DAGs a test breaks on purpose.

Hand-built plans: ``tests.helpers.cand`` and ``plan``.
"""

from __future__ import annotations

from dataclasses import replace

from nereus_lightning.spec.cluster import CLUSTER_PRESETS, ClusterSpec
from nereus_lightning.spec.workload import Workload
from nereus_lightning.transition import Node, TransitionDAG
from nereus_lightning.transition.scenarios import default_models

MODELS = default_models()
PPO = Workload("ppo")
CLUSTER = CLUSTER_PRESETS["paper_cluster3"]  # 8 nodes x 8 H200, 141 GB


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
