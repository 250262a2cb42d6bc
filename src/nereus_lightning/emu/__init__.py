"""Elastic Model Units: sharded model-stage replicas and the Split / Merge / Extend / Destroy primitives.

Typical use (every rank runs the same lines; members move state, others only record)::

    from nereus_lightning import emu

    actor = emu.create_unit("actor_train", config, model, Layout(2, 2), (0, 1, 2, 3), trains=True)
    op = emu.split("actor_train", emu.Unit(Layout(2, 2), (0, 1, 2, 3)), Layout(1, 2))
    report = emu.execute(op)  # this rank's TransferReport (bytes sent / received, seconds)
    state = emu.gather_logical_state("actor_train")  # full params, AdamW tensors, counters

A transition DAG node runs as ``emu.execute(op)`` for each ``op`` in
``emu.executor.ops_of(node)`` (a batched node carries one primitive per replica); a whole DAG as
``emu.execute_dag(dag)`` (every rank, same order; each rank issues every node it belongs to
asynchronously on the node's own groups and waits only for dependencies, so independent nodes
overlap, on disjoint ranks and on a shared one). On a member rank,
``registry().local(model_stage, unit)`` is this rank's :class:`EMU`: ``params`` and
``optim_state`` (plain tensors keyed by global names; models/ builds its modules on them) and
``counters``.
"""

from nereus_lightning.emu.check import LogicalState, StateMismatchError, gather_logical_state
from nereus_lightning.emu.executor import ExecutionReport, execute_dag
from nereus_lightning.emu.ops import (
    Destroy,
    Extend,
    Merge,
    Op,
    Recut,
    Split,
    canonical_merge_ranks,
    destroy,
    extend,
    from_node,
    merge,
    split,
    validate_op,
)
from nereus_lightning.emu.primitives import TransferReport, create_unit, execute
from nereus_lightning.emu.registry import Registry, registry
from nereus_lightning.emu.schema import OPTIM_KEYS, StateSchema
from nereus_lightning.emu.transfer import default_device
from nereus_lightning.emu.transfer_plan import Move, TransferPlan, plan_transfer, reshard_plan, unit_holdings
from nereus_lightning.emu.unit import EMU, Counters, replica_units
from nereus_lightning.plan.units import Position, Primitive, Unit, position_of

__all__ = [
    "EMU",
    "ExecutionReport",
    "OPTIM_KEYS",
    "Counters",
    "Destroy",
    "Extend",
    "LogicalState",
    "Merge",
    "Move",
    "Op",
    "Position",
    "Primitive",
    "Recut",
    "Registry",
    "Split",
    "StateMismatchError",
    "StateSchema",
    "TransferPlan",
    "TransferReport",
    "Unit",
    "canonical_merge_ranks",
    "create_unit",
    "default_device",
    "destroy",
    "execute",
    "execute_dag",
    "extend",
    "from_node",
    "gather_logical_state",
    "merge",
    "plan_transfer",
    "position_of",
    "reshard_plan",
    "registry",
    "replica_units",
    "split",
    "unit_holdings",
    "validate_op",
]
