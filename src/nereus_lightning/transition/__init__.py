"""Transitions between plans: local DAGs, the global DAG with resource edges, validation, ``L_tran``.

Pure Python (the brain). The body's executor runs :class:`TransitionDAG` nodes one-to-one::

    dag = build_transition(current, target, models, cluster, workload)  # InfeasiblePlanError: why
                                    # (immutable, cached: ``clear_cache()`` forgets them)
    report = validate(dag)          # replay: peers never share a GPU, memory under cap, last copy kept
    seconds = dag.cost              # L_tran = transition_cost(dag, cluster)
    for node in dag.nodes:          # topological order; node.deps are earlier ids
        node.op, node.model_stage, node.sources, node.targets, node.transfers
        for lane in node.lanes():   # a batched node (node.width > 1): one primitive call per replica
            lane.sources, lane.targets, lane.transfers

Peers are model-stages that run concurrently (same stage, disjoint GPUs) under both plans;
pairs colocated under either plan run in turn there and may share GPUs during the transition.
The calls of a step of a local DAG that no peer can make wait share one batched node (a
model-stage touching a GPU that may overflow goes per replica); the others are ordered one by
one, and alike calls of one model-stage that end up waiting for the same nodes share one node.

``per_component_baseline`` runs the same local DAGs without coordination, for comparison.
``pieces`` defines the byte formula every transfer uses; ``scenarios`` makes random plan pairs.
"""

from nereus_lightning.plan.units import common_layout
from nereus_lightning.transition.baseline import BaselineOutcome, per_component_baseline
from nereus_lightning.transition.build import build_transition, clear_cache
from nereus_lightning.transition.critical_path import Schedule, schedule, transition_cost
from nereus_lightning.transition.dag import MemEffect, Node, Primitive, TransitionDAG, Unit
from nereus_lightning.transition.pieces import Piece, Transfer, piece_bytes
from nereus_lightning.transition.validate import ValidationReport, validate

__all__ = [
    "BaselineOutcome",
    "MemEffect",
    "Node",
    "Piece",
    "Primitive",
    "Schedule",
    "Transfer",
    "TransitionDAG",
    "Unit",
    "ValidationReport",
    "build_transition",
    "clear_cache",
    "common_layout",
    "per_component_baseline",
    "piece_bytes",
    "schedule",
    "transition_cost",
    "validate",
]
