"""Candidate enumeration: every (layout, dp, micro-batch, recompute) of a model-stage, priced once.

A :class:`CandidateTable` prices all candidates of one model-stage and then answers, cheaply
and many times, "which candidates fit under this much memory (and keep at most this much state
resident)?" (the planner asks once per level of co-resident training state it tries).

One rule chooses among a model-stage's candidates on as many GPUs (:func:`leanest_within`): the
one with the smallest peak memory among those within :data:`LATENCY_TOLERANCE` of the fastest.
Predictions are not that exact, and the leaner candidate leaves headroom for drift and room for
the other model-stages on its GPUs.

A training layout's ZeRO variants (:func:`shard_options`) keep the unsharded layout's micro-batches
and recompute, their freed memory left as headroom; a layout too big unsharded shards only where
nothing else fits, as transitions move sharded state whole (:meth:`CandidateTable._training_rows`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from nereus_lightning.plan.calibration import Calibration
from nereus_lightning.plan.comm import canonical_links
from nereus_lightning.plan.cost import (
    Affine,
    StageWork,
    _offload,
    _optimizer_step,
    generation_batch,
    micro_batch_options,
    peak_memory,
    replica_sequences,
    slot_affine,
    wave_affine,
    wave_peak,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.memory import (
    boundary_state_bytes,
    training_pass_bytes,
    training_peak_of,
    training_state_terms,
)
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.model import ModelSpec

#: Candidates within this fraction of the fastest one on as many GPUs count as equally fast.
LATENCY_TOLERANCE = 0.02


@dataclass(frozen=True)
class Option:
    """One priced candidate shape of a model-stage (no GPU ids yet).

    ``peak_memory`` is the model-stage's own peak per GPU; ``resident`` is the state a training
    candidate keeps on each of its GPUs through the whole step (0 for generation and inference).
    """

    gpus: int
    latency: float
    layout: Layout
    dp: int
    micro_batch: int
    recompute: bool
    peak_memory: float
    resident: float = 0.0


def layouts_for(model: ModelSpec, max_gpus: int) -> list[Layout]:
    """Power-of-two (tp, pp) the model can be cut into, with at most ``max_gpus`` ranks."""
    out = []
    tp = 1
    while tp <= max_gpus and model.num_heads % tp == 0 and model.num_kv_heads % tp == 0:
        pp = 1
        while pp <= model.num_layers and tp * pp <= max_gpus:
            out.append(Layout(tp, pp))
            pp *= 2
        tp *= 2
    return out


def shard_options(layout: Layout, width: int, gpus_per_node: int) -> list[Layout]:
    """``layout`` (TP x PP) unsharded and its ZeRO variants for ``width`` (a power of two) data-parallel
    ranks: ZeRO-1, 2 and 3 at the largest shard degree whose replica fits in a node. A degree across
    nodes is priced (``comm``) but not enumerated: each width would add its own level of resident state
    to the planner's search.

    A smaller degree moves the same bytes as the node's (a reduce-scatter and an all-gather in the
    group, the rest across replicas) with more state per GPU and more of the AdamW step; a degree
    between the node's and ``width`` only trades the time and memory of those two; the shard group's
    collectives (once per optimizer step, ``cost._optimizer_step``) stay inside the node.
    """
    tp, pp = layout.tp, layout.pp
    in_node = min(width, 1 << (max(gpus_per_node // layout.size, 1).bit_length() - 1))
    out = [layout]
    if in_node > 1:
        out += [Layout(tp, pp, in_node, zero) for zero in (1, 2, 3)]
    return out


def dp_options(work: StageWork, layout: Layout, max_gpus: int) -> list[int]:
    """DP degrees worth pricing: training ones keep ``dp * b * a`` fixed (powers of two, so DP
    groups align to nodes); for generation/inference, the smallest dp per distinct replica share."""
    top = max_gpus // layout.size
    if work.trains:
        return [1 << k for k in range(top.bit_length()) if replica_sequences(work, 1 << k) is not None]
    out, n, dp = [], work.sequences, 1
    while dp <= min(top, n):
        out.append(dp)
        share = -(-n // dp)
        if share == 1:
            break
        dp = -(-n // (share - 1))  # the smallest dp whose share is below this one
    return out


class _Scalars:
    """Calibrated seconds of one model-stage's cost pieces, evaluated in O(1) per candidate.

    Mirrors :func:`cost.ideal_time` term by term (so it agrees with ``estimate_plan`` up to
    float rounding): each affine piece collapses to ``fixed + per_seq * n`` seconds.
    """

    def __init__(self, calibration: Calibration | None, kind: str) -> None:
        # The efficiencies of this stage kind's operations (the classes ``<kind>.<operation>``).
        prefix = f"{kind}."
        self.eff = {
            c.removeprefix(prefix): e
            for c, e in (calibration or Calibration()).efficiencies().items()
            if c.startswith(prefix)
        }

    def scalar(self, ideal: Mapping[str, float]) -> float:
        """Calibrated seconds of an ideal-time dict (by operation)."""
        return sum(seconds / self.eff[name] for name, seconds in ideal.items())

    def affine(self, piece: Affine) -> tuple[float, float, float, float, float, float]:
        """(fixed, per_seq, steps / eff_decode, decode_flops, decode_fixed, decode_per_seq)."""
        fixed = sum(v / self.eff[c] for c, v in piece.fixed)
        per_seq = sum(v / self.eff[c] for c, v in piece.per_seq)
        decode = piece.steps / self.eff["decode"] if piece.steps else 0.0
        return fixed, per_seq, decode, piece.decode_flops, piece.decode_fixed, piece.decode_per_seq


def _at(coef: tuple[float, float, float, float, float, float], n: int) -> float:
    fixed, per_seq, steps, flops, reads, kv = coef
    value = fixed + per_seq * n
    if steps:
        value += steps * max(flops * n, reads + kv * n)
    return value


class CandidateTable:
    """All candidates of one model-stage within ``max_gpus`` GPUs and ``cap`` bytes, priced.

    For generation and inference only the smallest dp of each distinct replica share is kept
    (larger ones cost GPUs and gain nothing). Per (layout, dp) the table keeps the feasible
    micro-batch / recompute choices ordered by latency, each leaner than every faster one, so
    :meth:`rows_within` can pick those that fit a tighter memory budget without pricing anything
    again.
    """

    def __init__(
        self,
        work: StageWork,
        cluster: ClusterSpec,
        calibration: Calibration | None,
        max_gpus: int,
        cap: float,
    ) -> None:
        self.work, self.cluster, self.cap = work, cluster, cap
        sc = _Scalars(calibration, work.kind)
        # generation: (layout, wave coefficients, offload seconds, dps); others: (gpus, layout, dp,
        # resident bytes, [(latency, peak, micro_batch, recompute)] fastest first)
        self.waves: list[tuple] = []
        self.rows: list[tuple] = []
        # Training rows offered only when no other fits (:meth:`_training_rows`); empty once they are.
        self.unmovable: list[tuple] = []
        trains = work.trains
        mb_cache: dict[int, tuple[int, ...]] = {}
        for layout in layouts_for(work.model, max_gpus):
            one = canonical_links(layout, 1, cluster)
            offload = sc.scalar(_offload(work, layout))
            dps = dp_options(work, layout, max_gpus)
            if work.kind == "generation":
                if generation_batch(work, layout, work.sequences, cap):
                    self.waves.append(
                        (layout, sc.affine(wave_affine(work, layout, one, cluster)), offload, dps)
                    )
                continue
            if trains:
                self._training_rows(work, layout, sc, dps, mb_cache)
                continue
            pp = layout.pp
            fixed, per_seq = sc.affine(slot_affine(work, layout, False, one, cluster))[:2]
            per_mb: dict[tuple[int, ...], list[tuple[int, float, float]]] = {}  # mbs -> priced
            for dp in dps:
                share = -(-work.sequences // dp)
                mbs = mb_cache.get(share)
                if mbs is None:
                    mbs = mb_cache[share] = micro_batch_options(work, layout, share, cap)
                # Inference memory grows with the micro-batch: one pass keeps the lean choices.
                priced = per_mb.get(mbs)
                if priced is None:
                    priced = per_mb[mbs] = []
                    for mb in mbs:
                        peak = peak_memory(work, layout, dp, mb, False)
                        if peak > cap:
                            break
                        priced.append((mb, peak, fixed + per_seq * mb))
                choices = []
                fastest, bubble = math.inf, pp - 1
                for mb, peak, slot in priced:
                    lat = (-(-share // mb) + bubble) * slot + offload
                    if lat < fastest:
                        fastest = lat
                        choices.append((lat, peak, mb, False))
                if choices:
                    choices.reverse()
                    self.rows.append((dp * layout.size, layout, dp, 0.0, choices))
        if not self.rows:
            self.rows, self.unmovable = self.unmovable, []
        # By resident state, so that a band of it is one slice (the planner asks for one level often).
        self.rows.sort(key=lambda row: row[3])
        self.residents = [row[3] for row in self.rows]

    def _training_rows(
        self,
        work: StageWork,
        base: Layout,
        sc: _Scalars,
        widths: list[int],
        mb_cache: dict[int, tuple[int, ...]],
    ) -> None:
        """The rows of a training model-stage cut as ``base`` (TP x PP), for every data-parallel width
        and every ZeRO variant of it (:func:`shard_options`).

        A ZeRO variant takes only the micro-batch and recompute choices that ``base`` itself fits at
        that width (all where ``base`` fits none): the state it frees is headroom, so its peak is below
        the unsharded one's. A transition moves a sharded stage as its shard groups, each holding its
        state whole (``transition.build``), so where ``base`` fits at no width its ZeRO variants go to
        :attr:`unmovable`, which the table offers only when nothing else fits."""
        cluster, cap, pp = self.cluster, self.cap, base.pp
        repeats = work.epochs * work.mini_batches
        one = canonical_links(base, 1, cluster)
        slots = {rc: sc.affine(slot_affine(work, base, rc, one, cluster))[:2] for rc in (False, True)}
        model, ends = work.model, ((0, pp - 1) if pp > 1 else (0,))
        passes: dict[tuple, tuple[float, ...]] = {}  # (mb, rc, in flight) -> per end rank (ZeRO-free)
        rows: list[tuple] = []
        movable = False  # base fits at some width
        for width in widths:
            variants: list[tuple] = []
            share = work.mini_batch_size // width
            mbs = mb_cache.get(share)
            if mbs is None:
                mbs = mb_cache[share] = micro_batch_options(work, base, share, cap)
            unsharded: set[tuple[int, bool]] = set()  # the (mb, rc) the base layout fits at this width
            for layout in shard_options(base, width, cluster.gpus_per_node):
                dp = width // layout.shard
                terms = [training_state_terms(model, layout, r) for r in ends]
                links = canonical_links(layout, dp, cluster)
                step = sc.scalar(_optimizer_step(work, layout, dp, links, cluster))
                choices = []
                for rc, (fixed, per_seq) in slots.items():
                    for mb in mbs:
                        count = -(-share // mb)
                        key = (mb, rc, count if count < pp else pp)
                        run = passes.get(key)
                        if run is None:
                            run = passes[key] = tuple(
                                training_pass_bytes(
                                    model, base, r, mb, work.max_len, key[2], rc, work.lm_head
                                )
                                for r in ends
                            )
                        # = peak_memory(work, layout, dp, mb, rc), its terms shared by the ZeRO variants
                        peak = max(training_peak_of(t, p) for t, p in zip(terms, run, strict=True))
                        if layout.shard == 1 and peak <= cap:
                            unsharded.add((mb, rc))
                        if peak <= cap and (layout.shard == 1 or not unsharded or (mb, rc) in unsharded):
                            lat = repeats * ((count + pp - 1) * (fixed + per_seq * mb) + step)
                            choices.append((lat, peak, mb, rc))
                if len(choices) > 1:
                    choices.sort()
                    lean = [choices[0]]  # only choices leaner than every faster one can ever be picked
                    for choice in choices[1:]:
                        if choice[1] < lean[-1][1]:
                            lean.append(choice)
                    choices = lean
                if choices:
                    resident = boundary_state_bytes(work.model, True, layout)
                    variants.append((width * base.size, layout, dp, resident, choices))
            rows += undominated(variants)
            movable = movable or bool(unsharded)
        (self.rows if movable else self.unmovable).extend(rows)

    def options(self, memory: float | None = None, resident: float = math.inf) -> list[Option]:
        """The choices per (layout, dp) whose peak fits ``memory`` (default: the cap) and whose
        resident state is at most ``resident``: the fastest, and the leaner ones within
        :data:`LATENCY_TOLERANCE` of it (only those can be the GPU count's :func:`leanest_within`)."""
        return [_option(row) for row in self.rows_within(memory, resident)]

    def rows_within(
        self, memory: float | None = None, resident: float = math.inf, least: float = -math.inf
    ) -> list[tuple]:
        """:meth:`options` as plain tuples ``(gpus, latency, peak, resident, layout, dp, mb, rc)``,
        only those keeping at least ``least`` bytes of state resident."""
        memory = self.cap if memory is None else memory
        work, out = self.work, []
        n = work.sequences
        for layout, coef, offload, dps in self.waves:
            fit = generation_batch(work, layout, n, memory)
            if not fit:
                continue
            size = layout.size
            for dp in dps:
                share = -(-n // dp)
                batch = share if share < fit else fit
                full, rest = divmod(share, batch)
                lat = offload + full * _at(coef, batch) + (_at(coef, rest) if rest else 0.0)
                out.append((dp * size, lat, wave_peak(work, layout, batch), 0.0, layout, dp, batch, False))
        lo = bisect.bisect_left(self.residents, least)
        for gpus, layout, dp, res, choices in self.rows[
            lo : bisect.bisect_right(self.residents, resident, lo)
        ]:
            limit = math.inf  # the tolerance over the fastest choice that fits
            for lat, peak, mb, rc in choices:  # fastest first, each leaner than the ones before
                if lat > limit:
                    break
                if peak <= memory:
                    if limit == math.inf:
                        limit = lat * (1 + LATENCY_TOLERANCE)
                    out.append((gpus, lat, peak, res, layout, dp, mb, rc))
        return out

    def next_leaner(self, option: Option) -> Option | None:
        """The choice of ``option``'s layout and dp that comes after it: leaner and slower (None: none,
        or a generation option, whose batch is whatever fits)."""
        for gpus, layout, dp, res, choices in self.rows:
            if (layout, dp) != (option.layout, option.dp):
                continue
            at = [(mb, rc) for _, _, mb, rc in choices].index((option.micro_batch, option.recompute))
            if at + 1 == len(choices):
                return None
            lat, peak, mb, rc = choices[at + 1]
            return Option(gpus, lat, layout, dp, mb, rc, peak, res)
        return None

    def resident_levels(self) -> list[float]:
        """Distinct per-GPU resident state of this table's candidates (training only), ascending."""
        return sorted({row[3] for row in self.rows})


def fastest_sharded(table: CandidateTable, gpus: int) -> tuple[Option, bool] | None:
    """The fastest ZeRO-sharded candidate of ``table`` (a training model-stage's) on ``gpus`` GPUs under its
    cap, and whether the table offers it (False: one of :attr:`CandidateTable.unmovable`); None: none."""
    best: tuple[Option, bool] | None = None
    for offered, rows in ((True, table.rows), (False, table.unmovable)):
        for count, layout, dp, res, choices in rows:
            lat, peak, mb, rc = choices[0]
            if count == gpus and layout.shard > 1 and (best is None or lat < best[0].latency):
                best = (Option(count, lat, layout, dp, mb, rc, peak, res), offered)
    return best


def undominated(rows: list[tuple]) -> list[tuple]:
    """Rows ``(gpus, layout, dp, resident, choices)`` of one GPU count without those another row beats:
    the same resident state, and for each of its choices one at most as slow and as large (on a tie
    the earlier row stays).

    Only a row of the same state stands in for another: the planner also asks for the candidates of
    exactly one state level (colocated training model-stages, :meth:`CandidateTable.rows_within`'s
    ``least``), and there a leaner row of another level is absent. On its own level a row can be a
    GPU count's :func:`leanest_within` choice, and a faster one than the choice on the leaner row's
    level, whose tolerance may pick a slower, leaner candidate."""
    kept: list[tuple] = []
    for row in rows:
        if any(_beats(other, row) for other in kept):
            continue
        kept = [other for other in kept if not _beats(row, other)]
        kept.append(row)
    return kept


def _beats(a: tuple, b: tuple) -> bool:
    """Whether row ``a`` keeps ``b``'s state and has, for each choice of ``b``, one at most as slow and as
    large (``a``'s choices are fastest first, each leaner than the ones before)."""
    if a[3] != b[3]:
        return False
    lats = [c[0] for c in a[4]]
    for lat, peak, _, _ in b[4]:
        at = bisect.bisect_right(lats, lat) - 1  # the leanest of a's choices at most this slow
        if at < 0 or a[4][at][1] > peak:
            return False
    return True


class _Point(Protocol):
    @property
    def gpus(self) -> int: ...
    @property
    def latency(self) -> float: ...


P = TypeVar("P", bound=_Point)


def frontier(options: Iterable[P]) -> list[P]:
    """Non-dominated points (options, or colocated groups): increasing GPU count, strictly
    decreasing latency."""
    best: list[P] = []
    for opt in sorted(options, key=lambda o: (o.gpus, o.latency)):
        if not best or opt.latency < best[-1].latency:
            best.append(opt)
    return best


def leanest_within(rows: Iterable[tuple], tolerance: float = LATENCY_TOLERANCE) -> tuple:
    """The row ``(gpus, latency, peak, ...)`` with the smallest peak among those whose latency is
    within ``tolerance`` of the fastest (on a tie the faster; then the first)."""
    rows = list(rows)
    if len(rows) == 1:
        return rows[0]
    limit = min(row[1] for row in rows) * (1 + tolerance)
    pick = None
    for row in rows:
        if row[1] <= limit and (pick is None or (row[2], row[1]) < (pick[2], pick[1])):
            pick = row
    assert pick is not None  # the fastest row is within the limit
    return pick


def frontier_of_rows(rows: list[tuple]) -> list[Option]:
    """:func:`frontier` of :meth:`CandidateTable.rows_within` tuples, each GPU count represented by
    its :func:`leanest_within` row (only the survivors become Options)."""
    best: list[tuple] = []
    # Sorted, each GPU count's rows are adjacent and fastest first; ties keep their order (the
    # leaner, then less resident state, ...).
    for _, same in itertools.groupby(sorted(rows), key=lambda row: row[0]):
        row = leanest_within(same)
        if not best or row[1] < best[-1][1]:
            best.append(row)
    return [_option(row) for row in best]


def _option(row: tuple) -> Option:
    gpus, lat, peak, res, layout, dp, mb, rc = row
    return Option(gpus, lat, layout, dp, mb, rc, peak, res)


def stage_options(
    work: StageWork, cluster: ClusterSpec, calibration: Calibration | None, max_gpus: int, cap: float
) -> list[Option]:
    """Every candidate of ``work`` (fastest micro-batch per layout and dp) within the pool and ``cap``."""
    return CandidateTable(work, cluster, calibration, max_gpus, cap).options()
