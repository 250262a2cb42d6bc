"""A sharded training unit re-cut to another shard degree in place: its row blocks move, nothing else whole.

At each ``(pp, tp)`` position the shard ranks' row blocks (the AdamW state, at ZeRO-3 the parameters
too: the EMU's ``row_keys``) are re-cut by :func:`~nereus_lightning.emu.transfer.recut_rows`, which
sends exactly the moves :func:`~nereus_lightning.plan.rows.row_moves` lists. A rank new to the unit
also receives, from the old rank :func:`~nereus_lightning.plan.rows.first_sources` names, what
every shard rank holds whole: at ZeRO-1/2 the parameters, and always the AdamW ``step`` counters
and the unit's counters. ``transition.pieces.recut_transfers`` prices the same lists (the steps and
counters unpriced, as for an Extend).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.emu.transfer import Traffic, add_traffic, recut_rows, start_broadcast
from nereus_lightning.emu.unit import EMU, Counters
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.rows import first_sources, row_moves
from nereus_lightning.plan.units import Unit
from nereus_lightning.spec.errors import require


def recut(
    model_stage: str, schema: StateSchema, state: EMU | None, old: Unit, new: Unit, device: torch.device
) -> tuple[EMU | None, Traffic]:
    """This rank's EMU of ``new`` re-cut from ``state`` (its EMU of ``old``; None off ``old``), and what it
    sent and received. Every rank of ``old`` and ``new`` calls it; ``old`` and ``new`` have the same
    model cut and ZeRO stage, another shard degree (a rank of neither returns ``(None, Traffic())``).
    """
    a, b = old.layout, new.layout
    require(
        (a.tp, a.pp, a.zero) == (b.tp, b.pp, b.zero) and a.zero > 0,
        "recut",
        f"{a} -> {b} is not a change of the shard degree alone",
    )
    me = dist.get_rank()
    if me not in old.gpus and me not in new.gpus:
        return None, Traffic()
    m = a.model_size
    i = (old.gpus.index(me) if me in old.gpus else new.gpus.index(me)) % m
    before, after = old.gpus[i::m], new.gpus[i::m]
    inner = Layout(a.tp, a.pp)
    names, keys, shapes = _row_cut(schema, a, i)
    blocks = {f"{n}/{k}": state.tensor(n, k) for n in names for k in keys[n]} if state is not None else {}
    rows, traffic = recut_rows(blocks, shapes, before, after, device)
    whole, counters, sent = _whole(
        schema, inner, names, a.zero < 3, state, first_sources(before, after), device
    )
    add_traffic(traffic, sent)
    if me not in after:
        return None, traffic
    params = {n: rows[f"{n}/param"] if a.zero == 3 else whole[n]["param"] for n in names}
    optim = {
        n: {k: rows[f"{n}/{k}"] for k in keys[n] if k != "param"} | {"step": whole[n]["step"]} for n in names
    }
    emu = EMU(model_stage, schema, new, me, params, optim, counters, trains=True)
    emu.row_keys = frozenset(k for n in names for k in keys[n])
    return emu, traffic


def _whole(
    schema: StateSchema,
    inner: Layout,
    names: tuple[str, ...],
    with_params: bool,
    state: EMU | None,
    sources: dict[int, int],
    device: torch.device,
) -> tuple[dict[str, dict[str, Tensor]], Counters, Traffic]:
    """What this rank holds whole after the re-cut (the parameters ``with_params``, the AdamW steps, the
    counters) and the traffic it took: its own where it held the unit; a rank new to it receives them
    from its first source (``sources``) in one broadcast with that source's other new ranks."""
    me = dist.get_rank()
    src = sources.get(me, me)
    receivers = tuple(sorted(r for r, s in sources.items() if s == src))
    if state is not None:
        whole = {n: {"param": state.params[n], "step": state.optim_state[n]["step"]} for n in names}
        counters = state.counters.as_tensor(device)
    else:
        whole = {
            n: {
                "param": torch.empty(schema.shard_shape(n, inner), dtype=schema.dtype_of(n), device=device),
                "step": torch.empty((), dtype=torch.float32, device=device),
            }
            for n in names
        }
        counters = torch.empty(Counters.size(), dtype=torch.int64, device=device)
    if not receivers:
        return whole, Counters.from_tensor(counters), Traffic()
    views = [whole[n][k] for k in (("param", "step") if with_params else ("step",)) for n in names]
    traffic = start_broadcast([*views, counters], src, (src, *receivers), device).wait()
    return whole, Counters.from_tensor(counters), traffic


def _row_cut(
    schema: StateSchema, layout: Layout, index: int
) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """At position ``index`` of a sharded ``layout``: the tensor names, the keys each cuts into row blocks
    (its AdamW moments; at ZeRO-3 its parameter too) and each ``name/key``'s whole shape and dtype."""
    inner = Layout(layout.tp, layout.pp)
    names = schema.stage_names(inner, index // layout.tp)
    keys = {n: (("param",) if layout.zero == 3 else ()) + schema.shaped_optim_keys(n) for n in names}
    shapes = {
        f"{n}/{k}": (
            schema.shard_shape(n, inner),
            schema.dtype_of(n) if k == "param" else schema.key_dtype(n, k),
        )
        for n in names
        for k in keys[n]
    }
    return names, keys, shapes


def recut_rank_sets(schema: StateSchema, old: Unit, new: Unit) -> list[tuple[int, ...]]:
    """Every rank set whose group :func:`recut` uses (the same list on every rank): per position, the ranks
    that move rows, and each first source with the new ranks it sends to."""
    a, m = old.layout, old.layout.model_size
    out: list[tuple[int, ...]] = []
    for i in range(m):
        before, after = old.gpus[i::m], new.gpus[i::m]
        _, _, shapes = _row_cut(schema, a, i)
        moves = row_moves({key: shape[0] for key, (shape, _) in shapes.items()}, before, after)
        out.append(tuple(sorted({r for move in moves for r in (move.src, move.dst)})))
        sources = first_sources(before, after)
        out += [
            (src, *sorted(r for r, s in sources.items() if s == src)) for src in sorted(set(sources.values()))
        ]
    return out
