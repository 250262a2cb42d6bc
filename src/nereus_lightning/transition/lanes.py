"""The primitive calls of a local DAG (*lanes*) and how they become nodes.

:class:`LocalLanes` collects a model-stage's lanes, one at a time or a whole bulk of one primitive
at once (:class:`LaneBulk`, columnar: flat units and memory effects, the transfers as one
:class:`TransferRecipe`), and makes them into one node per lane or one batched node per step.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from itertools import repeat

from nereus_lightning.transition.dag import LaneRuns, MemEffect, Node, Primitive, Unit
from nereus_lightning.transition.pieces import Transfer


class TransferRecipe:
    """The transfers of a bulk's lanes, made only when read: lane ``i``'s are
    ``make(*(column[i] for column in args))``."""

    __slots__ = ("make", "args")

    def __init__(self, make: Callable[..., list[Transfer]], args: tuple[Sequence, ...]) -> None:
        self.make, self.args = make, args

    def __len__(self) -> int:
        return len(self.args[0])

    def per_lane(self) -> list[Callable[[], list[Transfer]]]:
        """Each lane's transfers as a function (built when called)."""
        return list(map(partial, repeat(self.make), *self.args))

    def take(self, idx: list[int]) -> TransferRecipe:
        """The recipe of lanes ``idx`` only."""
        return TransferRecipe(self.make, tuple(list(map(column.__getitem__, idx)) for column in self.args))

    def build(self) -> list[Transfer]:
        """Every lane's transfers, concatenated."""
        out: list[Transfer] = []
        for transfers in map(self.make, *self.args):
            out += transfers
        return out


class LaneBulk:
    """Lanes of one primitive added at once, columnar: sources, targets and memory effects flat
    (``sizes``: how many of each one lane has), per lane its deps, the transfers as a recipe;
    ``steps`` one step for all or per lane."""

    __slots__ = ("steps", "op", "srcs", "tgts", "deps", "mem", "sizes", "transfers")

    def __init__(
        self, steps: int | list[int], op: Primitive, srcs, tgts, deps, mem, sizes, transfers: TransferRecipe
    ) -> None:
        self.steps, self.op, self.srcs, self.tgts = steps, op, srcs, tgts
        self.deps, self.mem, self.sizes, self.transfers = deps, mem, sizes, transfers

    def per_lane(self) -> Iterator[tuple]:
        """``(sources, targets, transfers, deps, mem)`` of each lane."""
        ns, nt, nm = self.sizes
        n = len(self.deps)
        return zip(
            _lanes_of(self.srcs, ns, n),
            _lanes_of(self.tgts, nt, n),
            self.transfers.per_lane(),
            self.deps,
            _lanes_of(self.mem, nm, n),
            strict=True,
        )

    def by_step(self) -> Iterator[tuple[int, LaneBulk]]:
        """``(step, lanes)`` of each step (in step order), the lanes as a bulk of one step, in order."""
        steps = self.steps
        if isinstance(steps, int):
            yield steps, self
            return
        ns, nt, nm = self.sizes
        n = len(self.deps)
        period = len(set(steps))
        if not n % period and steps[:period] * (n // period) == steps:
            # Steps repeat with a period (e.g. chains of one length): each step's lanes are a slice.
            for st, i in sorted(zip(steps[:period], range(period), strict=True)):
                yield (
                    st,
                    LaneBulk(
                        st,
                        self.op,
                        _every(self.srcs, ns, i, period),
                        _every(self.tgts, nt, i, period),
                        self.deps[i::period],
                        _every(self.mem, nm, i, period),
                        self.sizes,
                        TransferRecipe(
                            self.transfers.make, tuple(column[i::period] for column in self.transfers.args)
                        ),
                    ),
                )
            return
        order = sorted(range(n), key=steps.__getitem__)  # stable: each step's lanes stay in order
        ordered = list(map(steps.__getitem__, order))
        srcs = self.srcs if ns == 1 else list(_lanes_of(self.srcs, ns, n))
        tgts = self.tgts if nt == 1 else list(_lanes_of(self.tgts, nt, n))
        mem = self.mem if nm == 1 else list(_lanes_of(self.mem, nm, n))
        lo = 0
        for st in sorted(set(ordered)):
            hi = bisect.bisect_right(ordered, st, lo)
            idx = order[lo:hi]
            yield (
                st,
                LaneBulk(
                    st,
                    self.op,
                    _pick(srcs, idx, ns),
                    _pick(tgts, idx, nt),
                    list(map(self.deps.__getitem__, idx)),
                    _pick(mem, idx, nm),
                    self.sizes,
                    self.transfers.take(idx),
                ),
            )
            lo = hi


def _lanes_of(flat: Sequence, size: int, n: int) -> Iterator[tuple]:
    """``flat`` cut into ``n`` consecutive tuples of ``size``."""
    return zip(*[iter(flat)] * size, strict=True) if size else repeat((), n)


def _every(flat: Sequence, size: int, i: int, period: int) -> Sequence:
    """The flat entries of lanes ``i``, ``i + period``, ... (``size`` entries a lane)."""
    if size == 1:
        return flat[i::period]
    if not size:
        return []
    step = period * size
    return list(
        itertools.chain.from_iterable(zip(*[flat[i * size + q :: step] for q in range(size)], strict=True))
    )


def _pick(per_lane: Sequence, idx: list[int], size: int) -> list:
    """The flat entries of lanes ``idx`` (``per_lane``: flat entries if ``size`` is 1, else tuples)."""
    if size == 1:
        return list(map(per_lane.__getitem__, idx))
    if not size:
        return []
    return list(itertools.chain.from_iterable(map(per_lane.__getitem__, idx)))


class LocalLanes:
    """A local DAG's primitive calls (*lanes*), made into one node per lane or one per step.

    ``add(step, ...)`` returns the lane's id (its node id when unbatched, from 0); deps name
    lane ids. Steps are numbered so that every lane depends on lanes of earlier steps only,
    which keeps batched nodes (one per step, in step order) topologically ordered. Lanes added
    in bulk (:meth:`add_many`) are kept columnar until made into nodes.
    """

    __slots__ = ("name", "_records", "_steps")

    def __init__(self, name: str) -> None:
        self.name = name
        # single lanes (step, op, sources, targets, transfers, deps, mem) and bulks, in lane order
        self._records: list[tuple | LaneBulk] = []
        self._steps: list[int] = []  # per lane its step

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, op: Primitive, srcs, tgts, transfers, deps, mem) -> int:
        """One lane; returns its id."""
        self._records.append((step, op, srcs, tgts, transfers, deps, mem))
        self._steps.append(step)
        return len(self._steps) - 1

    def append(self, lane: tuple) -> int:
        """One lane given as ``(step, op, sources, targets, transfers, deps, mem)``; returns its id."""
        self._records.append(lane)
        self._steps.append(lane[0])
        return len(self._steps) - 1

    def next_id(self) -> int:
        """The id the next lane gets."""
        return len(self._steps)

    def add_many(
        self,
        steps: int | list[int],
        op: Primitive,
        srcs: Sequence[Unit],
        tgts: Sequence[Unit],
        deps: list,
        mem: Sequence[MemEffect],
        sizes: tuple[int, int, int],
        make: Callable[..., list[Transfer]],
        *args: Sequence,
    ) -> None:
        """Several lanes of one primitive at once, ids from :meth:`next_id`: ``steps`` one for all
        or per lane, ``deps`` per lane; ``srcs``, ``tgts`` and ``mem`` flat, each lane having
        ``sizes`` (sources, targets, memory effects) of them; lane ``i``'s transfers are
        ``make(*(column[i] for column in args))``, built when read."""
        self._steps += [steps] * len(deps) if isinstance(steps, int) else steps
        self._records.append(LaneBulk(steps, op, srcs, tgts, deps, mem, sizes, TransferRecipe(make, args)))

    def _each_lane(self) -> Iterator[tuple]:
        """``(op, sources, targets, transfers, deps, mem)`` of every lane, in id order."""
        for rec in self._records:
            if isinstance(rec, tuple):
                yield rec[1:]
            else:
                op = rec.op
                for lane in rec.per_lane():
                    yield (op, *lane)

    def nodes(self, batch: bool, first_id: int = 0) -> list[Node]:
        """The nodes, ids from ``first_id``: one per lane, or (``batch``) one per step with its
        lanes concatenated and the union of their deps."""
        name = self.name
        if not batch:
            out: list[Node] = []
            for op, srcs, tgts, transfers, deps, mem in self._each_lane():
                out.append(
                    Node(
                        first_id + len(out),
                        op,
                        name,
                        srcs,
                        tgts,
                        transfers,
                        [first_id + d for d in deps] if first_id else list(deps),
                        mem,
                    )
                )
            return out
        steps = sorted(set(self._steps))
        node_of = dict(zip(steps, itertools.count(first_id)))
        lane_node = (
            [first_id] * len(self._steps) if len(steps) == 1 else list(map(node_of.__getitem__, self._steps))
        )
        by_step: dict[int, list[tuple | LaneBulk]] = {st: [] for st in steps}
        for rec in self._records:
            if isinstance(rec, tuple):
                by_step[rec[0]].append(rec)
            else:
                for st, part in rec.by_step():
                    by_step[st].append(part)
        out = []
        chain = itertools.chain.from_iterable
        for st, recs in by_step.items():
            if len(recs) == 1 and isinstance(recs[0], LaneBulk):  # e.g. a bulk Split or Merge: as it is
                rec = recs[0]
                n = len(rec.deps)
                out.append(
                    Node(
                        node_of[st],
                        rec.op,
                        name,
                        tuple(rec.srcs),
                        tuple(rec.tgts),
                        rec.transfers.build,  # built when read
                        sorted(set(map(lane_node.__getitem__, chain(rec.deps)))),
                        tuple(rec.mem),
                        lanes=LaneRuns([(n, *rec.sizes)], rec.transfers.per_lane) if n > 1 else None,
                    )
                )
                continue
            srcs, tgts, mems, parts, deps, runs = [], [], [], [], [], []
            for rec in recs:
                if isinstance(rec, tuple):
                    _, op, s, t, transfers, d, m = rec
                    srcs.append(s)
                    tgts.append(t)
                    mems.append(m)
                    parts.append(transfers)
                    deps.append(d)
                    runs.append((1, len(s), len(t), len(m)))
                else:
                    op = rec.op
                    srcs.append(rec.srcs)
                    tgts.append(rec.tgts)
                    mems.append(rec.mem)
                    parts.append(rec.transfers)
                    deps += rec.deps
                    runs.append((len(rec.deps), *rec.sizes))
            out.append(
                Node(
                    node_of[st],
                    op,
                    name,
                    tuple(chain(srcs)),
                    tuple(chain(tgts)),
                    partial(_concat, parts),  # built when read
                    sorted(set(map(lane_node.__getitem__, chain(deps)))),
                    tuple(chain(mems)),
                    lanes=LaneRuns(runs, partial(_lane_parts, parts)) if len(deps) > 1 else None,
                )
            )
        return out


def _concat(parts: list) -> list[Transfer]:
    """The transfers of a batched node: each lane's or bulk's (built now if given as a function
    or a recipe)."""
    out: list[Transfer] = []
    for p in parts:
        if type(p) is TransferRecipe:
            out += p.build()
        elif p:
            out += p() if callable(p) else p
    return out


def _lane_parts(parts: list) -> list:
    """Per lane its transfers (or their function), bulks' recipes made per lane."""
    out = []
    for p in parts:
        if type(p) is TransferRecipe:
            out += p.per_lane()
        else:
            out.append(p)
    return out
