"""Functions the gloo pool runs on every rank (module-level so they pickle by reference)."""

from __future__ import annotations

import torch

from nereus_lightning.emu import (
    Counters,
    Unit,
    create_unit,
    destroy,
    execute,
    extend,
    gather_logical_state,
    merge,
    registry,
    split,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import NereusConfigError

COUNTERS = Counters(optimizer_step=3, update_count=3, policy_version=2, stage_version=1, sample_position=96, seed=1234)


def tiny(kind: str = "llama", layers: int = 4):
    """A tiny fp32 causal LM with random weights (same on every rank) and a random full AdamW state."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, max_position_embeddings=64)
    if kind == "llama":
        config = LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)
    elif kind == "gqa_tied":
        config = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True, **common)
    elif kind == "qwen2":
        config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    gen = torch.Generator().manual_seed(1)
    optim = {
        name: {
            "exp_avg": torch.randn(p.shape, generator=gen),
            "exp_avg_sq": torch.rand(p.shape, generator=gen),
            "step": torch.tensor(3.0),
        }
        for name, p in model.named_parameters()
    }
    return config, model, optim


def start(kind: str, layout: Layout, ranks: tuple[int, ...], stage: str = "actor_train", trains: bool = True):
    """A fresh registry with one unit of ``stage``."""
    registry().clear()
    config, model, optim = tiny(kind)
    create_unit(stage, config, model, layout, ranks, trains=trains, full_optim=optim if trains else None, counters=COUNTERS)
    return config, model, optim


def chain(rank: int, world: int, kind: str):
    """(TP2,PP2)x1 -> Split -> (TP1,PP2)x2 -> Destroy -> Extend -> Split -> Merge -> (TP2,PP1)x2 -> Merge -> (TP4,PP1)x1.

    Returns, after every primitive, the differences of the gathered state from the start, and the reports.
    """
    config, model, optim = start(kind, Layout(2, 2), (0, 1, 2, 3))
    before = gather_logical_state("actor_train", dst=0)
    initial = []
    if rank == 0:
        expected = {n: p.detach() for n, p in model.named_parameters()}
        initial = [n for n in expected if not torch.equal(before.params[n], expected[n])]
        initial += [n for n in optim if not torch.equal(before.optim[n]["exp_avg"], optim[n]["exp_avg"])]
    stage = "actor_train"
    steps = []

    def run(op):
        report = execute(op)
        after = gather_logical_state(stage, dst=0)
        steps.append((op.kind, before.differences(after) if rank == 0 else None, report))
        return op

    s = run(split(stage, Unit(Layout(2, 2), (0, 1, 2, 3)), Layout(1, 2)))
    a, b = s.targets
    run(destroy(stage, b))
    e = run(extend(stage, a, [b.ranks]))
    units = []
    for unit in (e.source, *e.targets):
        units += run(split(stage, unit, Layout(1, 1))).targets
    by_rank = {u.ranks[0]: u for u in units}
    m1 = run(merge(stage, [by_rank[0], by_rank[1]], Layout(2, 1), schema=registry().schema(stage)))
    m2 = run(merge(stage, [by_rank[2], by_rank[3]], Layout(2, 1), schema=registry().schema(stage)))
    run(merge(stage, [m1.target, m2.target], Layout(4, 1) if kind != "qwen2" else Layout(2, 2)))
    live = [str(u) for u in registry().live(stage)]
    return initial, [(kind, diff) for kind, diff, _ in steps], [r for _, _, r in steps], live


def pp_and_tp_pairs(rank: int, world: int, kind: str):
    """Every single-step Split and Merge on 4 ranks between (TP2,PP2), (TP1,PP4), (TP4,PP1) and their halves."""
    out = []
    stage = "actor_train"
    for big, small in ((Layout(1, 4), Layout(1, 2)), (Layout(4, 1), Layout(2, 1)), (Layout(2, 2), Layout(1, 1)), (Layout(1, 4), Layout(1, 1))):
        if kind == "qwen2" and big.tp == 4:
            continue  # 2 KV heads
        start(kind, big, (0, 1, 2, 3))
        before = gather_logical_state(stage, dst=0)
        op = split(stage, Unit(big, (0, 1, 2, 3)), small)
        execute(op)
        mid = gather_logical_state(stage, dst=0)
        back = merge(stage, op.targets, big, schema=registry().schema(stage))
        report = execute(back)
        after = gather_logical_state(stage, dst=0)
        diffs = (before.differences(mid), before.differences(after)) if rank == 0 else (None, None)
        out.append((str(big), str(small), *diffs, back.target.ranks, report.payload_sent))
    return out
