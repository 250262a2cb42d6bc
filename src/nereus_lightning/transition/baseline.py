"""The per-component baseline (DynaRL-style): each model-stage migrates on its own.

The same local DAGs, run independently: no resource edges and no global order. A runtime
that ignores other model-stages *races* (an Extend may land on GPUs a concurrent peer of the
same stage still holds, or co-resident state may overflow memory); one that blocks each acquisition until
its GPUs are free may *wait in a cycle*. For comparison only (the paper's Table 5).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from nereus_lightning.plan.layout import Plan
from nereus_lightning.plan.memory import memory_cap
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import Workload
from nereus_lightning.transition.build import make_context, union_of_local_dags
from nereus_lightning.transition.dag import TransitionDAG
from nereus_lightning.transition.validate import ValidationReport, validate


@dataclass(frozen=True)
class BaselineOutcome:
    """What the per-component migration does: ``outcome`` is ``ok``, ``conflict`` or ``wait cycle``."""

    dag: TransitionDAG
    report: ValidationReport  # the racing runtime's replay
    wait_cycle: bool  # a blocking runtime would deadlock
    outcome: str

    @property
    def ok(self) -> bool:
        """Whether the per-component migration is safe."""
        return self.outcome == "ok"


def per_component_baseline(
    current: Plan, target: Plan, models: Mapping[str, ModelSpec], cluster: ClusterSpec, workload: Workload
) -> BaselineOutcome:
    """Run the local DAGs independently and report whether that is safe (see the module docstring)."""
    ctx = make_context(current, target, models, cluster, workload)
    dag = TransitionDAG(tuple(union_of_local_dags(ctx)), ctx, global_order=False)
    report = validate(dag)
    cycle = _blocking_deadlocks(dag)
    outcome = "wait cycle" if cycle else ("ok" if report.valid else "conflict")
    return BaselineOutcome(dag, report, cycle, outcome)


def _blocking_deadlocks(dag: TransitionDAG) -> bool:
    """Each model-stage runs its local DAG in order; an acquisition waits while its GPUs are held
    by a peer (``TransitionContext.peers``) or lack memory. True if every component ends up waiting."""
    ctx = dag.context
    cap = memory_cap(ctx.cluster)
    peers = {name: set(others) for name, others in ctx.peers.items()}
    mem: dict[int, float] = defaultdict(float)
    held: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, c in ctx.current.items():
        per = ctx.memory_of(name, c.layout)
        for g in c.gpus:
            mem[g] += per
            held[g][name] += 1
    queues: dict[str, list] = defaultdict(list)
    for n in dag.nodes:
        queues[n.model_stage].append(n)
    pos = {name: 0 for name in queues}
    while True:
        moved = False
        for name, q in queues.items():
            while pos[name] < len(q):
                n = q[pos[name]]
                if any(c and o in peers[name] for g in n.acquired_gpus for o, c in held[g].items()):
                    break
                if any(mem[g] + max(net, 0.0) + tr > cap * (1 + 1e-9) for g, net, tr in n.mem):
                    break
                for g, net, _ in n.mem:
                    mem[g] += net
                for g in n.acquired_gpus:
                    held[g][name] += 1
                for g in n.released_gpus:
                    held[g][name] -= 1
                pos[name] += 1
                moved = True
        if all(pos[name] == len(q) for name, q in queues.items()):
            return False
        if not moved:
            return True
