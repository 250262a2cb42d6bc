"""`Layout`, `Candidate` and `Plan`: what runs where (no predictions; see the cost model for those)."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

from nereus_lightning.spec.errors import NereusConfigError, require

#: ZeRO stages: what a shard group cuts into row blocks (each stage adds to the one before).
ZERO_STAGES = {1: "optimizer state", 2: "+ gradients", 3: "+ parameters"}


@dataclass(frozen=True, order=True)
class Layout:
    """The shape of one replica (an EMU): ``shard`` x ``tp`` x ``pp`` ranks, every parallel dimension
    of a model-stage but the replica count (torchtitan's ``ParallelDims`` without ``dp``).

    ``shard`` is the ZeRO degree inside the replica: its ``shard`` groups of ``tp * pp`` ranks are
    data-parallel with each other (each runs its own micro-batches of the replica's share) and
    together hold one copy of the training state, every tensor of a ``(pp, tp)`` position cut into
    ``shard`` dim-0 row blocks (FSDP2's layout). ``zero`` is the ZeRO stage (:data:`ZERO_STAGES`),
    0 exactly when nothing is sharded.
    """

    tp: int = 1
    pp: int = 1
    shard: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        require(self.tp >= 1, "layout.tp", f"must be >= 1, got {self.tp}")
        require(self.pp >= 1, "layout.pp", f"must be >= 1, got {self.pp}")
        require(self.shard >= 1, "layout.shard", f"must be >= 1, got {self.shard}")
        require(
            self.zero in (0, *ZERO_STAGES),
            "layout.zero",
            f"must be 0 or one of {list(ZERO_STAGES)}, got {self.zero}",
        )
        require(
            (self.zero == 0) == (self.shard == 1),
            "layout.zero",
            f"zero={self.zero} with shard={self.shard}: a ZeRO stage needs shard > 1, and shard > 1 a ZeRO "
            "stage",
        )

    @property
    def size(self) -> int:
        """Ranks per replica."""
        return self.shard * self.tp * self.pp

    @property
    def model_size(self) -> int:
        """Ranks of one shard group's model cut (``tp * pp``): a replica is ``shard`` of them."""
        return self.tp * self.pp

    def __str__(self) -> str:
        zero = f"Z{self.zero}x{self.shard} " if self.shard > 1 else ""
        return f"{zero}TP{self.tp}xPP{self.pp}"


@dataclass(frozen=True)
class Candidate:
    """One model-stage's choice: ``dp`` replicas of ``layout`` on ``gpus``.

    ``gpus`` lists global GPU ids replica-major, then shard rank, then pipeline stage, then TP rank
    (TP varies fastest, so a TP group sits on neighbouring GPUs, inside a node when it fits).
    Only training model-stages may shard (``layout.shard > 1``).
    """

    layout: Layout
    dp: int
    gpus: tuple[int, ...]
    micro_batch: int = 1
    recompute: bool = False

    def __post_init__(self) -> None:
        require(self.dp >= 1, "candidate.dp", f"must be >= 1, got {self.dp}")
        require(self.micro_batch >= 1, "candidate.micro_batch", f"must be >= 1, got {self.micro_batch}")
        # The GPU checks format their messages only on failure: a plan makes many candidates of
        # up to thousands of GPUs each.
        size = self.dp * self.layout.size
        if len(self.gpus) != size:
            raise NereusConfigError(
                f"candidate.gpus: {len(self.gpus)} GPUs given for dp={self.dp} x {self.layout} = {size}"
            )
        if len(set(self.gpus)) != len(self.gpus):
            raise NereusConfigError(f"candidate.gpus: GPU ids repeat in {self.gpus}")

    @property
    def num_gpus(self) -> int:
        """GPUs this model-stage occupies."""
        return len(self.gpus)

    @property
    def data_parallel(self) -> int:
        """Ranks that run micro-batches of their own: every shard rank of every replica."""
        return self.dp * self.layout.shard

    def replica_gpus(self, replica: int) -> tuple[int, ...]:
        """The GPUs of replica ``replica`` (shard-major, then pp, tp-minor)."""
        size = self.layout.size
        return self.gpus[replica * size : (replica + 1) * size]

    def gpu_at(self, replica: int, pp_rank: int, tp_rank: int, shard_rank: int = 0) -> int:
        """The GPU holding position (shard_rank, pp_rank, tp_rank) of replica ``replica``."""
        lay = self.layout
        return self.gpus[replica * lay.size + (shard_rank * lay.pp + pp_rank) * lay.tp + tp_rank]

    def same_units(self, other: Candidate) -> bool:
        """Whether ``other`` holds the same units (the same layout on the same GPUs): a change of the
        micro-batch or recompute alone moves no state."""
        return (self.layout, self.gpus) == (other.layout, other.gpus)

    def shard_groups(self) -> Candidate:
        """The ZeRO-0 candidate of this one's shard groups: ``dp * shard`` replicas of ``Layout(tp, pp)`` on
        the same GPUs; itself when unsharded. Each shard rank computes as such a replica (its own rows
        through a whole ``(tp, pp)`` model), and holds such a replica's state while its state is whole
        (a transition's transfers read and write whole ``(tp, pp)`` pieces)."""
        layout = self.layout
        if layout.shard == 1:
            return self
        inner = Layout(layout.tp, layout.pp)
        return Candidate(inner, self.dp * layout.shard, self.gpus, self.micro_batch, self.recompute)

    def describe(self) -> str:
        """A short human-readable form, e.g. ``dp4 TP2xPP1 mb2`` or ``dp1 Z2x4 TP2xPP1 mb2``."""
        rc = " rc" if self.recompute else ""
        return f"dp{self.dp} {self.layout} mb{self.micro_batch}{rc}"


@dataclass(frozen=True)
class Plan:
    """A candidate for every model-stage, keyed by model-stage name (see ``spec.workload``)."""

    assignments: tuple[tuple[str, Candidate], ...]

    @classmethod
    def of(cls, mapping: Mapping[str, Candidate]) -> Plan:
        """Build from a mapping, keeping its order."""
        return cls(tuple(mapping.items()))

    def __getitem__(self, model_stage: str) -> Candidate:
        for name, cand in self.assignments:
            if name == model_stage:
                return cand
        raise KeyError(f"plan has no model-stage {model_stage!r}; it has {[n for n, _ in self.assignments]}")

    def __contains__(self, model_stage: object) -> bool:
        return any(name == model_stage for name, _ in self.assignments)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.assignments)

    def items(self) -> tuple[tuple[str, Candidate], ...]:
        """(model-stage, candidate) pairs in workflow order."""
        return self.assignments

    def as_dict(self) -> dict[str, Candidate]:
        """A plain dict copy."""
        return dict(self.assignments)

    def replace(self, model_stage: str, candidate: Candidate) -> Plan:
        """A copy with one model-stage's candidate replaced."""
        return Plan(tuple((n, candidate if n == model_stage else c) for n, c in self.assignments))


def moving_shard_groups(current: Plan, target: Plan, recut: Collection[str]) -> tuple[Plan, Plan]:
    """``current`` and ``target`` (the same model-stages) with each ZeRO-sharded model-stage whose units
    change as its shard groups (:meth:`Candidate.shard_groups`), as a transition moves it: each shard
    group holding its state whole. A model-stage that keeps its units (:meth:`Candidate.same_units`, its
    micro-batch or recompute may change) keeps its candidate, and its row blocks; so does one in
    ``recut``, whose row blocks are re-cut to another shard degree in place
    (:func:`~nereus_lightning.plan.rows.recut_in_place`)."""
    moving = {
        n
        for n, c in current.items()
        if not c.same_units(target[n]) and max(c.layout.shard, target[n].layout.shard) > 1 and n not in recut
    }
    if not moving:
        return current, target

    def grouped(plan: Plan) -> Plan:
        return Plan(tuple((n, c.shard_groups() if n in moving else c) for n, c in plan.items()))

    return grouped(current), grouped(target)
