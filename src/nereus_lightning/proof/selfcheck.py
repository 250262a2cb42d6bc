"""Self-check of a model family: sharded vs unsharded logits on a tiny random model of the family.

:func:`check_model` (and ``nereus-check-model``) shrinks a transformers config to a tiny one of the
same family and features (GQA or not, tying, biases, sliding windows, soft-capping, fused
projections), draws random weights, and compares on ``world_size`` gloo ranks of this machine:
the sharded logits and token log-probs against the unsharded transformers model at every layout
that fits, the values of the family's value model (token classification, one label), and the
logits after a Split/Merge chain of an EMU (whose gathered state must stay bit-identical). The
rank functions are module-level, so the test suite runs them on its shared worker pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nereus_lightning.models.groups import ReplicaComm, prepare_groups, replica_groups
from nereus_lightning.models.pipeline import forward_logits, split_micro_batches, token_logprobs
from nereus_lightning.models.sharded import ShardedCausalLM, is_tied, validate_layout
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.verdicts import on_trial
from nereus_lightning.testing.shrink import tiny_config_of, tiny_model_of, value_config_of

BATCH, SEQ = 4, 12
#: (tp, pp) layouts tried, where the world size and the tiny model allow them.
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4))


def layouts_of(config: Any, world_size: int, layouts: Sequence[tuple[int, int]] = LAYOUTS) -> list[Layout]:
    """The ``(tp, pp)`` layouts that ``config`` allows and ``world_size`` ranks hold."""
    out = []
    for tp, pp in layouts:
        layout = Layout(tp, pp)
        if world_size % layout.size:
            continue
        try:
            validate_layout(config, layout)
        except NereusConfigError:
            continue
        out.append(layout)
    return out


def _replica(rank: int, world: int, layout: Layout, tied: bool) -> tuple[int, ReplicaComm]:
    """Cover the world with replicas of ``layout`` (groups made on all ranks); this rank's index and comm."""
    size = layout.size
    replicas = [tuple(range(i * size, (i + 1) * size)) for i in range(world // size)]
    replica_groups(replicas, layout, tied=tied)
    dp = tuple(r[rank % size] for r in replicas)
    return rank // size, ReplicaComm.of(replicas[rank // size], layout, rank, tied=tied, dp_ranks=dp)


def _batch(config: Any, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + index)  # replicas see different batches
    return torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _grad_error(model: torch.nn.Module, sharded: ShardedCausalLM, config: Any, ids: torch.Tensor) -> float:
    """Relative error of one training step's gradients (after the TP/tied sums) against the full model's.

    Per tensor, relative to that tensor's largest reference entry (floored at 1e-3 of the largest
    overall, so a tensor whose gradient is all but zero is not judged by rounding noise).
    """
    from nereus_lightning.models.pipeline import MicroBatch, train_step
    from nereus_lightning.models.sharded import shard_state

    adv = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(7))

    def loss(outputs: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return -(outputs * mb.extras["adv"]).mean()

    model.zero_grad()
    ref_lp = torch.log_softmax(model(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    loss(ref_lp, MicroBatch(ids, extras={"adv": adv})).backward()
    ref = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    comm = sharded.comm
    expected = shard_state(ref, config, comm.layout, comm.pp_rank, comm.tp_rank)
    train_step(sharded, split_micro_batches(ids, 2, adv=adv), loss)
    got = {n: p.grad for n, p in sharded.named_parameters()}
    scale = max(float(g.abs().max()) for g in expected.values())
    worst_err = 0.0
    for name, want in expected.items():
        grad = got[name]
        have = grad if grad is not None else torch.zeros_like(want)
        floor = max(float(want.abs().max()), 1e-3 * scale, 1e-30)
        worst_err = max(worst_err, float((have.double() - want.double()).abs().max()) / floor)
    return worst_err


def _one_layout(
    rank: int, world: int, model: torch.nn.Module, config: Any, layout: Layout, grads: bool
) -> dict[str, float]:
    """One layout's errors: logits (a value model's values), log-probs and, with ``grads``, gradients."""
    from nereus_lightning.models.sharded import has_value_head

    index, comm = _replica(rank, world, layout, is_tied(config))
    sharded = ShardedCausalLM.from_model(model, comm)
    ids = _batch(config, index)
    with torch.no_grad():
        ref = model(ids).logits
    errors: dict[str, float] = {}
    out = forward_logits(sharded, split_micro_batches(ids, 2), where="all")
    assert out is not None  # where="all": every rank gets them
    value = has_value_head(config)
    errors["values" if value else "logits"] = _rel_err(out, ref)
    if not value:
        ref_lp = torch.log_softmax(ref.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp = token_logprobs(sharded, split_micro_batches(ids, 2), where="all")
        assert lp is not None
        errors["logprobs"] = float((lp.double() - ref_lp).abs().max())
        if grads:  # every replica the same batch: the DP average is that batch's gradient
            errors["grads"] = _grad_error(model, sharded, config, _batch(config, 0))
    return errors


def layout_errors(
    rank: int,
    world: int,
    config: Any,
    layouts: Sequence[tuple[int, int]] = LAYOUTS,
    seed: int = 0,
    grads: bool = False,
) -> dict[str, float]:
    """On every rank, per layout of ``layouts`` that fits: the sharded model's errors against the full one.

    The relative error of the logits (a value model's values) and, for a causal LM, the absolute
    error of the token log-probs and, with ``grads``, the relative error of one step's gradients.
    """
    with on_trial(config.model_type):
        model = tiny_model_of(config, seed)
        errors: dict[str, float] = {}
        for layout in layouts_of(config, world, layouts):
            name = f"tp{layout.tp}pp{layout.pp}"
            for key, err in _one_layout(rank, world, model, config, layout, grads).items():
                errors[f"{name}/{key}"] = err
        return errors


def layout_outcomes(
    rank: int, world: int, config: Any, layouts: Sequence[tuple[int, int]] = LAYOUTS
) -> dict[str, dict[str, float] | str]:
    """As :func:`layout_errors` with gradients, but a layout that raises gives its error message instead.

    The admission check uses it: a family the generic path cannot represent fails where it breaks
    (its build or forward raises on every rank alike), and the layouts before it keep their verdicts.
    """
    with on_trial(config.model_type):
        model = tiny_model_of(config)
        out: dict[str, dict[str, float] | str] = {}
        for tp, pp in layouts:
            layout, name = Layout(tp, pp), f"tp{tp}pp{pp}"
            try:
                if world % layout.size:
                    raise NereusConfigError(f"{world} ranks do not hold {layout}")
                validate_layout(config, layout)
                out[name] = _one_layout(rank, world, model, config, layout, grads=True)
            except Exception as exc:  # noqa: BLE001 - any failure refuses the layout, with its reason
                out[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return out


def chain_errors(rank: int, world: int, config: Any, seed: int = 0) -> dict[str, float]:
    """On 4 ranks: an EMU at (TP2, PP2) split to (TP1, PP2) x2, then (TP1, PP1) x4, merged to (TP2, PP1) x2
    and (TP2, PP2). Per step: the number of gathered tensors that differ from the start (rank 0; 0
    elsewhere) and the relative error of the logits of the replicas built on the moved shards."""
    with on_trial(config.model_type):
        return _chain_errors(rank, world, config, seed)


def _chain_errors(rank: int, world: int, config: Any, seed: int) -> dict[str, float]:
    from nereus_lightning.emu import Unit, create_unit, execute, gather_logical_state, merge, registry, split
    from nereus_lightning.emu.executor import communicating_rank_sets

    stage = "selfcheck"
    model = tiny_model_of(config, seed)
    tied = is_tied(config)
    registry().clear()
    create_unit(stage, config, model, Layout(2, 2), tuple(range(world)), trains=True)
    start = gather_logical_state(stage, dst=0)
    ids = _batch(config, 0)
    with torch.no_grad():
        ref = model(ids).logits
    errors: dict[str, float] = {}

    def check(label: str) -> None:
        units = registry().live(stage)
        replica_groups([u.gpus for u in units], units[0].layout, tied=tied)  # world-collective
        mine = next(u for u in units if rank in u.gpus)
        comm = ReplicaComm.of(mine.gpus, mine.layout, rank, tied=tied)
        sharded = ShardedCausalLM(config, comm, registry().local(stage, mine).params)
        logits = forward_logits(sharded, ids, where="all")
        assert logits is not None  # where="all": every rank gets them
        errors[f"{label}/logits"] = _rel_err(logits, ref)
        now = gather_logical_state(stage, dst=0)  # None except on rank 0, like start
        errors[f"{label}/state_diffs"] = (
            float(len(start.differences(now))) if start is not None and now is not None else 0.0
        )

    def run(op: Any) -> Any:
        prepare_groups(communicating_rank_sets([op]))  # members agree on their groups' names
        execute(op)
        return op

    first = run(split(stage, Unit(Layout(2, 2), tuple(range(world))), Layout(1, 2)))
    check("split_pp")
    for unit in first.targets:
        run(split(stage, unit, Layout(1, 1)))
    check("split_tp")
    by_rank = {u.gpus[0]: u for u in registry().live(stage)}
    pairs = [run(merge(stage, [by_rank[r], by_rank[r + 1]], Layout(2, 1))) for r in (0, 2)]
    check("merge_tp")
    run(merge(stage, [op.target for op in pairs], Layout(2, 2)))
    check("merge_pp")
    registry().clear()
    return errors


def worst(results: list[dict[str, float]]) -> dict[str, float]:
    """The worst value of every key over the ranks' results."""
    out: dict[str, float] = {}
    for errors in results:
        for key, value in errors.items():
            out[key] = max(out.get(key, 0.0), value)
    return out


def check_model(config: Any, world_size: int = 4) -> dict[str, float]:
    """Max errors of the sharded tiny model of ``config``'s family, per layout and check, on gloo ranks.

    Runs on ``world_size`` ranks. Keys: ``"tp2pp1/logits"`` (relative), ``".../logprobs"``
    (absolute), ``"value/tp2pp1/values"`` (relative) and, with 4 ranks, ``"chain/<step>/logits"``
    and ``"chain/<step>/state_diffs"`` (tensors whose gathered state changed). Refuses an
    unsupported family before any process starts.
    """
    from nereus_lightning.testing import WorkerPool

    tiny = tiny_config_of(config)
    with WorkerPool(world_size) as pool:  # its ranks put the family on trial themselves
        out = worst(pool.run(layout_errors, tiny))
        out.update(
            {f"value/{k}": v for k, v in worst(pool.run(layout_errors, value_config_of(tiny))).items()}
        )
        if world_size == 4:
            out.update({f"chain/{k}": v for k, v in worst(pool.run(chain_errors, tiny)).items()})
    return out
