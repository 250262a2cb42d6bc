"""ZeRO inside a replica: a shard group of data-parallel ranks holding one copy of the training state.

A replica of ``Layout(tp, pp, shard, zero)`` has ``shard`` ranks at each (pp, tp) position (its
*shard group*). Each runs its own micro-batches through a full (pp, tp) shard of the model (a
:class:`~nereus_lightning.models.sharded.ShardedCausalLM`), and holds dim-0 row blocks of that
shard's state, cut as FSDP2 cuts (:func:`~nereus_lightning.plan.rows.row_block`), so AdamW state
follows its parameter:

- ZeRO-1: the AdamW state (moments, fp32 master) as row blocks; gradients all-reduced over the shard
  group, each rank steps its rows, then the parameters are all-gathered back.
- ZeRO-2: as ZeRO-1, but the gradients are reduce-scattered, so a rank keeps only its rows' sum.
- ZeRO-3: the parameters too: the module's tensors are filled by an all-gather before use
  (:meth:`ZeroShards.gather`) and released after (:meth:`ZeroShards.release`).

Every collective packs the tensors of one dtype into flat tables of ``shard`` equal segments (each
block padded to ``ceil(rows / shard)`` rows; shard rank ``s``'s at its process-group rank,
:attr:`ShardGroup.table_rows`), cut along the segments into buckets of bounded bytes
(``sharded.FLAT_BUCKET_BYTES``), so a few reduce-scatters or all-gathers move them in bounded memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nereus_lightning.models.optim import bind_adamw, counted_once
from nereus_lightning.models.sharded import FLAT_BUCKET_BYTES, ShardedCausalLM, all_reduce_flat, flat_buckets
from nereus_lightning.plan.rows import row_block
from nereus_lightning.spec.errors import require

# torch 2.13 renamed the flat collectives (the old names warn there); earlier torch has the old ones only.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def cut_rows(tensor: Tensor, shard: int, shard_rank: int) -> Tensor:
    """``shard_rank``'s row block of ``tensor`` (a view)."""
    lo, hi = row_block(tensor.shape[0], shard, shard_rank)
    return tensor[lo:hi]


@dataclass(frozen=True)
class ShardGroup:
    """This rank's shard group: the ranks at its (pp, tp) position in each shard rank of its replica.

    ``ranks`` are in shard-rank order; ``group`` is their process group.
    """

    zero: int
    ranks: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup

    def __post_init__(self) -> None:
        require(self.zero in (1, 2, 3), "layout.zero", f"a shard group needs ZeRO 1, 2 or 3, got {self.zero}")
        require(self.rank in self.ranks, "rank", f"rank {self.rank} is not in shard group {self.ranks}")

    @property
    def shard(self) -> int:
        """The sharding degree."""
        return len(self.ranks)

    @property
    def shard_rank(self) -> int:
        """This rank's index in the group."""
        return self.ranks.index(self.rank)

    @functools.cached_property
    def table_rows(self) -> tuple[int, ...]:
        """Each shard rank's row in a collective's ``[shard, columns]`` table: its rank in the process
        group, which numbers its members by global rank, whatever the shard order."""
        return tuple(dist.get_group_rank(self.group, r) for r in self.ranks)


def _segment_sizes(full: Sequence[Tensor], shard: int) -> list[int]:
    return [-(-t.shape[0] // shard) * (t.numel() // max(t.shape[0], 1)) for t in full]


def _table_buckets(full: Sequence[Tensor], shard: int) -> tuple[list[int], list[list[tuple[int, int, int]]]]:
    """Each tensor's segment size and the buckets of segment columns (``sharded.flat_buckets``) whose
    ``[shard, columns]`` table holds at most :data:`~nereus_lightning.models.sharded.FLAT_BUCKET_BYTES`."""
    sizes = _segment_sizes(full, shard)
    columns = max(1, FLAT_BUCKET_BYTES // (full[0].element_size() * shard))
    return sizes, flat_buckets(sizes, columns)


def _padded_columns(flat: Tensor, size: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """Columns ``[lo, hi)`` of ``flat`` (a tensor's elements) seen as its ``[shard, size]`` padded table
    (row ``s``: row block ``s``, zero-padded): the rows of whole blocks as a ``[whole, hi - lo]`` view, and
    the one short block's columns that hold elements (empty when none)."""
    whole = flat.numel() // size
    short = flat[whole * size + lo : whole * size + hi]
    return flat[: whole * size].view(whole, size)[:, lo:hi], short


def reduce_scatter_rows(full: Sequence[Tensor], blocks: Sequence[Tensor], shards: ShardGroup) -> None:
    """Sum the contiguous full tensors ``full`` (one dtype) over the shard group into this rank's row
    ``blocks``, through ``[shard, columns]`` tables of at most ``FLAT_BUCKET_BYTES``."""
    if not full:
        return
    sizes, buckets = _table_buckets(full, shards.shard)
    at = shards.table_rows
    where = torch.tensor(at, device=full[0].device)
    for bucket in buckets:
        table = full[0].new_zeros(shards.shard, sum(hi - lo for _, lo, hi in bucket))
        offset = 0
        for i, lo, hi in bucket:
            rows, short = _padded_columns(full[i].view(-1), sizes[i], lo, hi)
            table[where[: len(rows)], offset : offset + hi - lo] = rows
            if len(rows) < shards.shard:
                table[at[len(rows)], offset : offset + len(short)] = short
            offset += hi - lo
        out = table.new_empty(table.shape[1])
        _reduce_scatter(out, table.view(-1), group=shards.group)
        offset = 0
        for i, lo, hi in bucket:
            block = blocks[i].view(-1)[lo:hi]  # the segment's columns past the block are padding
            block.copy_(out[offset : offset + len(block)])
            offset += hi - lo


def all_gather_rows(blocks: Sequence[Tensor], full: Sequence[Tensor], shards: ShardGroup) -> None:
    """Fill the contiguous full tensors ``full`` (one dtype) from every shard rank's row ``blocks``, through
    ``[shard, columns]`` tables of at most ``FLAT_BUCKET_BYTES``."""
    if not full:
        return
    sizes, buckets = _table_buckets(full, shards.shard)
    at = shards.table_rows
    where = torch.tensor(at, device=full[0].device)
    for bucket in buckets:
        mine = full[0].new_zeros(sum(hi - lo for _, lo, hi in bucket))
        offset = 0
        for i, lo, hi in bucket:
            block = blocks[i].reshape(-1)[lo:hi]
            mine[offset : offset + len(block)].copy_(block)
            offset += hi - lo
        table = mine.new_empty(shards.shard, len(mine))
        _all_gather(table.view(-1), mine, group=shards.group)
        offset = 0
        for i, lo, hi in bucket:
            rows, short = _padded_columns(full[i].view(-1), sizes[i], lo, hi)
            rows.copy_(table[where[: len(rows)], offset : offset + hi - lo])
            if len(rows) < shards.shard:
                short.copy_(table[at[len(rows)], offset : offset + len(short)])
            offset += hi - lo


def _by_dtype(pairs: Sequence[tuple[Tensor, Tensor]]) -> list[tuple[list[Tensor], list[Tensor]]]:
    groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for a, b in pairs:
        group = groups.setdefault(a.dtype, ([], []))
        group[0].append(a)
        group[1].append(b)
    return list(groups.values())


class ZeroShards:
    """One rank's ZeRO state of a sharded replica: its row blocks, and the AdamW stepping them.

    Args:
        module: this rank's compute module; its parameters are the full (pp, tp) shard, which at
            ZeRO-3 :meth:`gather` fills before use.
        shards: the rank's shard group.
        param_blocks: at ZeRO-3 the parameters' row blocks by global name (the unit's own tensors);
            None below ZeRO-3, where a block is a view of the module's parameter.
        optim_state: the row blocks' AdamW state by global name (``models.optim.adamw_keys``; the
            unit's own tensors, stepped in place); None starts a fresh AdamW.
        hyper: AdamW's keyword arguments.
    """

    def __init__(
        self,
        module: ShardedCausalLM,
        shards: ShardGroup,
        param_blocks: Mapping[str, Tensor] | None = None,
        optim_state: Mapping[str, Mapping[str, Tensor]] | None = None,
        **hyper: float | tuple[float, float],
    ) -> None:
        require(
            (param_blocks is not None) == (shards.zero == 3),
            "param_blocks",
            f"ZeRO-{shards.zero} {'needs' if shards.zero == 3 else 'takes no'} parameter row blocks",
        )
        self.module, self.shards = module, shards
        self.named = dict(module.named_parameters())
        if param_blocks is None:
            blocks = {n: cut_rows(p.detach(), shards.shard, shards.shard_rank) for n, p in self.named.items()}
        else:
            blocks = dict(param_blocks)
        self.blocks = {n: nn.Parameter(blocks[n], requires_grad=False) for n in self.named}
        self.optimizer = bind_adamw(self.blocks, optim_state, **hyper)
        self.counted = dict(zip(self.named, counted_once(module), strict=True))
        self.whole = True  # the module's parameters hold the blocks' current values (always below ZeRO-3)

    def gather(self) -> None:
        """ZeRO-3: give the module's parameters their full values from every shard rank's blocks (collective
        over the shard group); a no-op below ZeRO-3, whose parameters are always whole, and while they
        are whole already (every shard rank sees the same gathers and releases)."""
        if self.whole:
            return
        self.whole = True
        for p in self.named.values():
            p.untyped_storage().resize_(p.numel() * p.element_size())
        pairs = [(self.blocks[n].detach(), p.detach()) for n, p in self.named.items()]
        for blocks, full in _by_dtype(pairs):
            all_gather_rows(blocks, full, self.shards)

    def release(self) -> None:
        """ZeRO-3: free the module's full parameters (their shapes stay, their storage goes) until the
        next :meth:`gather`; a no-op below ZeRO-3."""
        if self.shards.zero < 3:
            return
        self.whole = False
        for p in self.named.values():
            p.untyped_storage().resize_(0)

    def whole_state(self) -> dict[str, dict[str, Tensor]]:
        """The AdamW state whole, as an unsharded replica holds it (by global name and key; collective over
        the shard group): new tensors of every shard rank's rows, the 0-d ``step`` shared. For readers of
        whole tensors (transfers, the logical state); the row blocks stay what the optimizer steps."""
        out: dict[str, dict[str, Tensor]] = {}
        pairs = []
        for n, block in self.blocks.items():
            shape = self.named[n].shape
            entry = out.setdefault(n, {})
            for key, rows in self.optimizer.state[block].items():
                entry[key] = rows if key == "step" else rows.new_empty(shape)
                if key != "step":
                    pairs.append((rows.detach(), entry[key]))
        for blocks, full in _by_dtype(pairs):
            all_gather_rows(blocks, full, self.shards)
        return out

    def step(self, max_norm: float, dp_group: dist.ProcessGroup | None) -> tuple[float, str | None]:
        """Reduce this rank's gradients into its row blocks (summed over the shard group and, through
        ``dp_group``, the replicas), clip them to ``max_norm`` by the replica's global norm and step the
        blocks; then all-gather the parameters (below ZeRO-3; at ZeRO-3 the stale full parameters are
        released until the next :meth:`gather`). Collective over the model-stage's ranks.

        Returns the norm before clipping and, when it is not finite (nothing stepped), the first
        parameter here whose gradient is not. The module's gradients are dropped either way.
        """
        grads = self._reduce_grads(dp_group)
        norm = self._norm(grads)
        problem = None
        if math.isfinite(norm):
            scale = min(max_norm / (norm + 1e-6), 1.0)
            for n, block in self.blocks.items():
                block.grad = grads[n].mul_(scale)
            self.optimizer.step()
            if self.shards.zero < 3:
                pairs = [(self.blocks[n].detach(), p.detach()) for n, p in self.named.items()]
                for blocks, full in _by_dtype(pairs):
                    all_gather_rows(blocks, full, self.shards)
        else:
            names = [n for n, g in grads.items() if not bool(torch.isfinite(g).all())]
            problem = f"first non-finite gradient here: {names[0]}" if names else "non-finite on another rank"
        for block in self.blocks.values():
            block.grad = None
        self.release()
        return norm, problem

    def _reduce_grads(self, dp_group: dist.ProcessGroup | None) -> dict[str, Tensor]:
        """This rank's row blocks of the gradients summed over every data-parallel rank; the module's
        full gradients dropped."""
        blocks = {n: torch.empty_like(b) for n, b in self.blocks.items()}
        pairs = [
            (p.grad if p.grad is not None else torch.zeros_like(p), blocks[n]) for n, p in self.named.items()
        ]
        if self.shards.zero == 1:  # the whole gradient on every rank, then each takes its rows
            for fulls, _ in _by_dtype(pairs):
                all_reduce_flat(fulls, self.shards.group)
            for grad, block in pairs:
                block.copy_(cut_rows(grad, self.shards.shard, self.shards.shard_rank))
        else:
            for fulls, parts in _by_dtype(pairs):
                reduce_scatter_rows(fulls, parts, self.shards)
        for p in self.named.values():
            p.grad = None
        if dp_group is not None:
            all_reduce_flat(list(blocks.values()), dp_group)
        return blocks

    def _norm(self, grads: Mapping[str, Tensor]) -> float:
        """The replica's global norm of the row blocks ``grads`` (every logical element once)."""
        device = next(iter(self.blocks.values())).device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for n, grad in grads.items():
            if self.counted[n]:
                total += grad.float().pow(2).sum()
        dist.all_reduce(total, group=self.shards.group)
        if self.module.comm.layout.size > 1:
            dist.all_reduce(total, group=self.module.comm.replica_group)
        return float(total.sqrt())
