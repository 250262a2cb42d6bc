"""Run a whole transition DAG on the EMU runtime, ready nodes concurrently, and measure every node.

Protocol: EVERY rank calls :func:`execute_dag` with the same DAG. Each rank walks the DAG's
nodes in the same topological order (``dag.nodes``; a batched node's lanes in lane order) and
*issues* each node it belongs to through :func:`nereus_lightning.emu.primitives.start`: its
collectives go out asynchronously on the node's own member groups (on NCCL each group has its
own stream; on gloo its own worker), and the walk goes on without waiting. A rank waits for a
node it issued only when a later node it issues depends on it (directly, or through nodes it is
not part of), and for everything at the end. So ready nodes that share a rank but use
independent groups run at the same time on that rank, as nodes on disjoint ranks always do. A
non-member only records the node in its registry.

No deadlock: every rank issues the collectives of every group in the same order (the DAG's),
and a rank blocks only on nodes earlier in that order; the earliest node still incomplete has
every member either past it (issued) or blocked on an even earlier one, so it completes.
The packed send buffers and the old shards of a reshard stay referenced (``emu.transfer.InFlight``)
until the collectives that read them have completed; received buffers are unpacked then.

Before anything moves, the whole DAG is replayed on a scratch copy of the registry (live
sources, free target ranks, never the last copy destroyed), so a DAG that does not fit the live
units fails on every rank with the same error and the state untouched.

Two node shapes of the transition brain go beyond the plain primitives and are handled here:

* a one-source Merge is a *re-ranking* (same layout and ranks, new order): it runs as a Merge
  (``emu.ops.validate_op`` accepts it), i.e. one P2P reshard moving each shard to its new rank;
* an Extend whose target shares ranks with its source (a rank at the same position: a local
  copy; at another position: it holds both shards): one broadcast per position, in position
  order, the shared rank cloning its shard locally (see :func:`_extend_overlapping`).

Measurements: per node and rank, the wall seconds from its issue to its completion (first seen
complete by a non-blocking poll at the walk's next steps, else when waited for), how many of
this rank's nodes were in flight (issued, not yet waited for) when it was issued, and the payload bytes
received
(tensor bytes, no alignment padding), next to the bytes the brain priced for that rank
(``transition.pieces.Transfer.bytes`` of the node's transfers into the rank's GPU, local copies
excluded). :meth:`ExecutionReport.reduce` combines the ranks (bytes summed; seconds the max over
the node's members, and the min: the last member to arrive waits for no one, so the min is the
node's own duration); :meth:`ExecutionReport.node_observations` is what the calibration reads.
Payload bytes are the priced bytes plus what the brain does not price: 48 bytes of counters
per receiving Extend position and, for training state, a 4-byte fp32 AdamW ``step`` per tensor
a rank receives for the first time. (Brain and EMU count the same state per parameter:
``StateSchema.element_bytes``; fp32: 4 bytes inference, param + exp_avg + exp_avg_sq = 12 bytes
training; bf16: 2 inference, 2 + fp32 exp_avg, exp_avg_sq and master = 14 training.)
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard

import torch
import torch.distributed as dist

from nereus_lightning.emu.ops import Destroy, Extend, Merge, Op, Recut, Split, from_node, ranked
from nereus_lightning.emu.primitives import Started, TransferReport
from nereus_lightning.emu.primitives import start as start_op
from nereus_lightning.emu.recut import recut_rank_sets
from nereus_lightning.emu.registry import Registry, registry
from nereus_lightning.emu.transfer import InFlight, default_device, start_broadcast
from nereus_lightning.emu.transfer_plan import reshard_plan
from nereus_lightning.emu.unit import EMU, Counters
from nereus_lightning.models.groups import prepare_groups
from nereus_lightning.plan.units import Primitive
from nereus_lightning.spec.errors import NereusConfigError, require

if TYPE_CHECKING:
    from nereus_lightning.transition.dag import Node, TransitionDAG


class NodeObservation(NamedTuple):
    """One node as the calibration sees it: priced vs measured bytes, and seconds."""

    node_id: int
    op: str
    predicted_bytes: int
    measured_bytes: int
    seconds: float


@dataclass(frozen=True)
class NodeRecord:
    """What one node did on one rank (or, in a reduced report, on all ranks together)."""

    node_id: int
    op: str
    model_stage: str
    ranks: tuple[int, ...]  # the global ranks the node involves
    predicted_bytes: int  # priced bytes into this rank's GPU (reduced: the node's total)
    measured_bytes: int  # payload bytes received (reduced: summed over ranks)
    seconds: float  # wall seconds of the call on this rank (reduced: max over members)
    fastest_seconds: float  # reduced: min over members (the last to arrive: the node's own time)
    member: bool  # this rank moved state in it (reduced: True)
    report: TransferReport | None = None  # this rank's TransferReport (None once reduced)
    in_flight: int = 0  # this rank's nodes in flight when it was issued, itself included (reduced: max)
    lanes: int = 1  # independent replicas the node carried (transition.dag.Node.width)
    running: int = 0  # of those in flight, how many a poll just before its issue found still incomplete (+1)


@dataclass(frozen=True)
class ExecutionReport:
    """Every node of one DAG execution, in execution order; ``rank`` is None once reduced."""

    rank: int | None
    records: tuple[NodeRecord, ...]
    seconds: float  # wall seconds of the whole walk (reduced: max over ranks)

    def node_observations(self, fastest: bool = False) -> list[NodeObservation]:
        """(node_id, op, predicted_bytes, measured_bytes, seconds) per node; ``fastest`` takes the
        min-over-members time.
        """
        return [
            NodeObservation(
                r.node_id,
                r.op,
                r.predicted_bytes,
                r.measured_bytes,
                r.fastest_seconds if fastest else r.seconds,
            )
            for r in self.records
        ]

    def reduce(self) -> ExecutionReport:
        """All ranks' reports combined (collective over the default group; every rank gets it)."""
        require(self.rank is not None, "report", "this report is already reduced")
        local = [(self.seconds, [_strip(r) for r in self.records])]
        everything: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everything, local[0])
        combined = []
        for i, mine in enumerate(self.records):
            parts = [records[i] for _, records in everything]
            members = [p.seconds for p in parts if p.member] or [0.0]
            combined.append(
                NodeRecord(
                    mine.node_id,
                    mine.op,
                    mine.model_stage,
                    mine.ranks,
                    sum(p.predicted_bytes for p in parts),
                    sum(p.measured_bytes for p in parts),
                    max(members),
                    min(members),
                    True,
                    None,
                    max(p.in_flight for p in parts),
                    mine.lanes,
                    max(p.running for p in parts),
                )
            )
        return ExecutionReport(None, tuple(combined), max(s for s, _ in everything))


def calibration_observations(dag: TransitionDAG, report: ExecutionReport) -> list[tuple[str, float, float]]:
    """``(name, predicted_s, measured_s)`` per node that moved bytes, for ``Calibration.observe``.

    ``predicted_s`` is the node's span in the brain's schedule (``transition.critical_path.schedule``:
    start to finish, link sharing included), ``measured_s`` its measured seconds in ``report``
    (reduced: the slowest member). ``name`` is ``transition/<op>/<link>``, the link class being
    ``inter`` if any transfer crosses machines, else ``intra`` (``local`` if every copy stays on
    its GPU), so a calibration can learn each link class's efficiency apart.
    """
    from nereus_lightning.transition.critical_path import schedule

    plan = schedule(dag)
    gpn = dag.context.cluster.gpus_per_node
    seconds = {r.node_id: r.seconds for r in report.records if r.member}
    out = []
    for node in dag.nodes:
        moves = [(t.src_gpu, t.dst_gpu) for t in node.transfers if t.bytes > 0]
        if not moves or node.id not in seconds:
            continue
        if any(s // gpn != d // gpn for s, d in moves):
            link = "inter"
        else:
            link = "intra" if any(s != d for s, d in moves) else "local"
        predicted = plan.finish[node.id] - plan.start[node.id]
        out.append((f"transition/{node.op.value}/{link}", predicted, seconds[node.id]))
    return out


def _strip(record: NodeRecord) -> NodeRecord:
    return NodeRecord(**{f.name: getattr(record, f.name) for f in fields(record) if f.name != "report"})


def execute_dag(
    dag: TransitionDAG,
    *,
    rank_of: Mapping[int, int] | None = None,
    device: torch.device | str | None = None,
    colocate: Mapping[str, Collection[str]] | None = None,
) -> ExecutionReport:
    """Execute every node of ``dag`` (a ``transition.TransitionDAG``); call on every rank.

    Args:
        dag: the transition DAG; its current plan's units must be live in the registry.
        rank_of: GPU id in the plans -> global rank (identity by default).
        device: where received shards live (``emu.default_device()`` by default).
        colocate: model-stage -> the model-stages whose units may share its ranks. By default the
            brain's rule: model-stages of different stages run one after another, and so do
            same-stage ones that share GPUs in the current or the target plan; only same-stage
            model-stages concurrent under both plans may not share a rank.

    Returns:
        This rank's :class:`ExecutionReport` (call :meth:`ExecutionReport.reduce` on every rank
        for the whole job's view).

    Raises:
        NereusConfigError: a node is malformed, or does not match the live units (nothing moved).
    """
    start = time.perf_counter()
    me = dist.get_rank()
    colocate = dict(colocate) if colocate is not None else _workflow_colocation(dag)
    gpu_of = {rank_of[g] if rank_of is not None else g: g for n in dag.nodes for g in n.gpus}
    lane_ops = [ops_of(node, rank_of) for node in dag.nodes]
    for node in dag.nodes:
        bad = [d for d in node.deps if d >= node.id]
        require(
            not bad, "dag.nodes", f"node #{node.id} depends on later nodes {bad}: not a topological order"
        )
    _dry_run([(node.id, op) for node, ops in zip(dag.nodes, lane_ops, strict=True) for op in ops], colocate)
    # Member groups are named by how many groups each process made before, so create every group
    # the walk will use now, world-collectively and in the same order on every rank.
    prepare_groups(communicating_rank_sets([op for ops in lane_ops for op in ops]))
    device = torch.device(device) if device is not None else default_device()
    mine = gpu_of.get(me)
    records: list[NodeRecord | None] = [None] * len(dag.nodes)
    flying: dict[int, _Issued] = {}  # this rank's nodes issued and not yet waited for
    # Per node: the in-flight nodes of this rank it needs finished first (itself, if issued here;
    # through a node this rank is not part of: that node's own needs).
    needs: list[frozenset[int]] = []
    # No autograd: pack/unpack then take their kernel path on GPU tensors and build no graph.
    with torch.no_grad():
        for node, ops in zip(dag.nodes, lane_ops, strict=True):
            _note_completions(flying)
            ranks = tuple(sorted({r for op in ops for u in (*op.sources, *op.targets) for r in u.gpus}))
            need = frozenset().union(*(needs[d] for d in node.deps)) if node.deps else frozenset()
            if me not in ranks:  # registry bookkeeping only
                for op in ops:
                    _start(op, tuple(colocate.get(op.model_stage, ())), device)
                needs.append(frozenset(n for n in need if n in flying))
                records[node.id] = NodeRecord(
                    node.id, ops[0].kind, node.model_stage, ranks, 0, 0, 0.0, 0.0, False, lanes=len(ops)
                )
                continue
            for nid in sorted(need):
                if nid in flying:
                    records[nid] = flying.pop(nid).finish()
            issued = _Issued(node, ops, ranks, mine)
            for op in ops:
                issued.lanes.append(_start(op, tuple(colocate.get(op.model_stage, ())), device))
            flying[node.id] = issued
            issued.in_flight = len(flying)
            issued.running = sum(1 for f in flying.values() if f.completed is None)
            needs.append(frozenset((node.id,)))
        for nid in sorted(flying):
            records[nid] = flying[nid].finish()
    return ExecutionReport(me, tuple(r for r in records if r is not None), time.perf_counter() - start)


def communicating_rank_sets(ops: Sequence[Op]) -> list[tuple[int, ...]]:
    """Every rank set the collectives of ``ops`` span (the same list on every rank)."""
    reg = registry()
    out: list[tuple[int, ...]] = []
    for op in ops:
        if isinstance(op, Extend):
            for i, sender in enumerate(op.source.gpus):
                out.append((sender, *(u.gpus[i] for u in op.targets if u.gpus[i] != sender)))
        elif isinstance(op, Recut):
            out += recut_rank_sets(reg.schema(op.model_stage), op.source, op.target)
        elif isinstance(op, (Split, Merge)):
            name = op.model_stage
            out.append(reshard_plan(op, reg.schema(name), reg.trains[name]).ranks())
    return out


def _start(op: Op, colocate_with: tuple[str, ...], device: torch.device) -> Started:
    if _overlapping(op):
        return _start_extend_overlapping(op, colocate_with, device)
    return start_op(op, colocate_with=colocate_with, device=device)


class _Issued:
    """One node issued on this rank: its lanes' started primitives and when they completed."""

    __slots__ = ("node", "ops", "ranks", "mine", "lanes", "began", "completed", "in_flight", "running")

    def __init__(self, node: Node, ops: list[Op], ranks: tuple[int, ...], mine: int | None) -> None:
        self.node, self.ops, self.ranks, self.mine = node, ops, ranks, mine
        self.lanes: list[Started] = []
        self.began = time.perf_counter()
        self.completed: float | None = None  # first seen complete by a poll
        self.in_flight = self.running = 1

    def finish(self) -> NodeRecord:
        """Wait for every lane; this rank's record of the node."""
        reports = [lane.wait() for lane in self.lanes]
        end = self.completed if self.completed is not None else time.perf_counter()
        seconds = end - self.began
        node = self.node
        predicted = sum(t.bytes for t in node.transfers if t.src_gpu != t.dst_gpu and t.dst_gpu == self.mine)
        report = reports[0] if len(reports) == 1 else _sum_reports(reports)
        return NodeRecord(
            node.id,
            self.ops[0].kind,
            node.model_stage,
            self.ranks,
            predicted,
            report.payload_received,
            seconds,
            seconds,
            True,
            report,
            self.in_flight,
            len(self.ops),
            self.running,
        )


def _note_completions(flying: Mapping[int, _Issued]) -> None:
    """Time-stamp the in-flight nodes whose collectives have all completed (never blocks)."""
    now = None
    for issued in flying.values():
        if issued.completed is None and all(lane.is_completed() for lane in issued.lanes):
            now = now or time.perf_counter()
            issued.completed = now


def _sum_reports(reports: list[TransferReport]) -> TransferReport:
    """The lanes of a batched node on this rank as one report."""
    first = reports[0]
    return TransferReport(
        first.kind,
        first.model_stage,
        first.rank,
        sum(r.sent_bytes for r in reports),
        sum(r.received_bytes for r in reports),
        sum(r.payload_sent for r in reports),
        sum(r.payload_received for r in reports),
        sum(r.buffers_sent for r in reports),
        tuple(sorted({p for r in reports for p in r.peers})),
        sum(r.freed_bytes for r in reports),
        max(r.seconds for r in reports),
    )


def ops_of(node: Node, rank_of: Mapping[int, int] | None = None) -> list[Op]:
    """The EMU op of every lane of a transition node (one for an ordinary node), see :func:`op_of`."""
    return [op_of(lane, rank_of) for lane in node.lanes()]


def op_of(node: Node, rank_of: Mapping[int, int] | None = None) -> Op:
    """The EMU op of a transition node, including an Extend that overlaps its source (checked here).

    A batched node (``node.width > 1``) is several ops: use :func:`ops_of`.
    """
    require(
        node.width == 1,
        "node",
        f"node #{node.id} carries {node.width} replicas; use emu.executor.ops_of(node) (one op per lane)",
    )
    if node.op is Primitive.EXTEND:
        (source,), targets = ranked(node.sources, rank_of), ranked(node.targets, rank_of)
        op = Extend(node.model_stage, source, targets)
        if _overlapping(op):
            used = [r for u in targets for r in u.gpus]
            require(len(targets) >= 1, "extend.targets", f"node #{node.id} has no target")
            require(
                len(set(used)) == len(used), "extend.targets", f"node #{node.id}: targets overlap each other"
            )
            require(
                all(u.layout == source.layout for u in targets),
                "extend.targets",
                f"node #{node.id}: copies keep the source layout",
            )
            return op
    return from_node(node, rank_of)


def _overlapping(op: Op) -> TypeGuard[Extend]:
    return isinstance(op, Extend) and any(r in op.source.gpus for u in op.targets for r in u.gpus)


def _workflow_colocation(dag: TransitionDAG) -> dict[str, tuple[str, ...]]:
    """Every model-stage may share ranks with all but its transition peers (the brain's rule:
    same-stage model-stages concurrent under both plans, ``TransitionContext.peers``)."""
    stages, peers = dag.context.stages, dag.context.peers
    return {name: tuple(o for o in stages if o != name and o not in peers.get(name, ())) for name in stages}


def _dry_run(ops: Sequence[tuple[int, Op]], colocate: Mapping[str, Collection[str]]) -> None:
    """Replay ``(node id, op)`` pairs on a scratch copy of this rank's registry picture (no state):
    raise before anything moves."""
    live = registry()
    scratch = Registry()
    for name in {op.model_stage for _, op in ops}:
        scratch.declare(name, live.schema(name), live.trains[name])
    for name, units in live.units.items():
        scratch.declare(name, live.schemas[name], live.trains[name])
        for unit in units:
            scratch.add(name, unit, None)
    world = dist.get_world_size()
    for i, op in ops:
        try:
            scratch.require_live(op.model_stage, op.sources)
            for unit in op.targets:
                scratch.schema(op.model_stage).validate(unit.layout)
            old = {r for u in op.sources for r in u.gpus}
            new = {r for u in op.targets for r in u.gpus} - old
            scratch.require_free(
                op.model_stage, new, ignore=op.sources, colocate_with=colocate.get(op.model_stage, ())
            )
            bad = sorted(r for r in new if not 0 <= r < world)
            require(not bad, "target ranks", f"ranks {bad} are outside the world (size {world})")
            if isinstance(op, Destroy) and len(scratch.live(op.model_stage)) <= 1:
                raise NereusConfigError(
                    f"destroy: {op.source} is the last copy of {op.model_stage!r}'s state"
                )
        except NereusConfigError as exc:
            raise NereusConfigError(
                f"transition DAG node #{i} ({op.kind} of {op.model_stage}): {exc}"
            ) from exc
        if not isinstance(op, Extend):
            for unit in op.sources:
                scratch.remove(op.model_stage, unit)
        for unit in op.targets:
            scratch.add(op.model_stage, unit, None)


def _start_extend_overlapping(op: Extend, colocate_with: Collection[str], device: torch.device) -> Started:
    """An Extend whose targets share ranks with its source: one broadcast per position, in position
    order, issued without waiting.

    A rank at the same position in source and target clones its shard locally; a rank at two
    positions sends one shard and receives the other (positions are issued in order on every rank,
    so the per-position groups cannot wait on each other in a cycle). The source stays alive.
    """
    began = time.perf_counter()
    reg = registry()
    name = op.model_stage
    schema, trains = reg.schema(name), reg.trains[name]
    reg.require_live(name, [op.source])
    for unit in op.targets:
        schema.validate(unit.layout)
    new_ranks = {r for u in op.targets for r in u.gpus} - set(op.source.gpus)
    reg.require_free(name, new_ranks, ignore=(op.source,), colocate_with=colocate_with)
    me = dist.get_rank()
    flight = InFlight()
    target = next((u for u in op.targets if me in u.gpus), None)
    mine = None
    if target is not None or me in op.source.gpus:
        src = reg.local(name, op.source) if me in op.source.gpus else None
        if target is not None:
            mine = EMU.empty(name, schema, target, me, trains=trains, device=device)
        counters = torch.empty(Counters.size(), dtype=torch.int64, device=device)
        for i, sender in enumerate(op.source.gpus):
            receivers = tuple(u.gpus[i] for u in op.targets)
            if me != sender and me not in receivers:
                continue
            others = tuple(r for r in receivers if r != sender)
            if me == sender:
                assert src is not None  # a sender is a rank of the source unit
                views = [t for _, _, t in src.tensors()] + [src.counters.as_tensor(src.device)]
                if me in receivers:  # same position in both units: a local copy
                    assert mine is not None  # a receiver is a rank of a target unit
                    for (_, _, new), old in zip(mine.tensors(), views[:-1], strict=True):
                        new.copy_(old)
                    mine.counters = src.counters
            else:
                assert mine is not None  # (a receiver, as above)
                views = [t for _, _, t in mine.tensors()] + [counters]
            if others:
                flight.add(start_broadcast(views, sender, (sender, *others), device))
            if me != sender:
                flight.then(lambda: setattr(mine, "counters", Counters.from_tensor(counters)))
    for unit in op.targets:
        reg.add(name, unit, mine if unit == target else None)
    return Started(op, flight, 0, began)


__all__ = [
    "ExecutionReport",
    "NodeObservation",
    "NodeRecord",
    "calibration_observations",
    "execute_dag",
    "op_of",
    "ops_of",
]
