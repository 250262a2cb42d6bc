"""The body executes the brain's Split/Merge plan, byte for byte, for every layout pair up to TP x PP = 16.

For each model shape the tests use (causal LMs and critics; and a wide one that admits TP 16 and
PP 16), each pair of layouts ``a -> b`` goes through ``T_sub``: Split ``a -> s``, Merge ``s -> b``
(canonical, reversed and shuffled rank orders; a shuffled Split too; a one-unit re-ranking when
``a == b``). Every (source, target) rank pair of the body's plan (``emu.reshard_plan``) moves exactly
the bytes the brain prices for it (``transition.tsub`` patterns placed on the units' GPUs), and every
target rank ends up with exactly its new shards: what it kept plus what it received, each part once.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest

from nereus_lightning.emu import Merge, Split, StateSchema, Unit, merge, reshard_plan, split, unit_holdings
from nereus_lightning.emu.transfer_plan import element_count
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.planner import job_models
from nereus_lightning.plan.units import common_layout, split_units
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.testing.tiny import tiny_config
from nereus_lightning.transition.pieces import geometry
from nereus_lightning.transition.scenarios import default_models
from nereus_lightning.transition.tsub import merge_pattern, placed, split_pattern

LAYOUTS = [Layout(t, p) for t in (1, 2, 4, 8, 16) for p in (1, 2, 4, 8, 16) if t * p <= 16]


def _llama(**kw):
    from transformers import LlamaConfig

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    return LlamaConfig(**{**common, **kw})


def _critic(kind: str):
    """The value model of ``tiny_config(kind)`` (as ``lightning.roles.build_value_model`` makes a critic)."""
    config = tiny_config(kind, num_labels=1, tie_word_embeddings=False)
    config.architectures = [type(config).__name__.removesuffix("Config") + "ForTokenClassification"]
    return config


SHAPES = {  # name: (config, parameter dtype)
    **{kind: (tiny_config(kind), "float32") for kind in ("llama", "qwen2", "gqa_tied", "qwen3", "mistral")},
    "llama_6_layers": (_llama(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=6), "float32"),
    "tied_8_layers": (
        _llama(num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=8, tie_word_embeddings=True),
        "float32",
    ),
    "gqa_tied_bf16": (tiny_config("gqa_tied"), "bfloat16"),
    # critics: the value head (TP-replicated, on the last stage) in place of the LM head
    "qwen2_critic": (_critic("qwen2"), "float32"),
    "qwen3_critic_bf16": (_critic("qwen3"), "bfloat16"),
    "wide_tied_17_layers": (  # TP 16 and PP 16 (uneven stages)
        _llama(
            hidden_size=64,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_hidden_layers=17,
            tie_word_embeddings=True,
        ),
        "bfloat16",
    ),
}


@pytest.mark.parametrize("shape, kind", [("qwen2_critic", "qwen2"), ("qwen3_critic_bf16", "qwen3")])
def test_the_role_mapping_gives_the_critic_these_value_model_shapes(shape: str, kind: str) -> None:
    """``plan.job_models`` (and ``transition.scenarios.default_models``, through it) price a job's
    critic and reward model as the value model of the actor's architecture: the critic shapes above."""
    config, dtype = SHAPES[shape]
    actor = replace(ModelSpec.from_hf_config(tiny_config(kind)), dtype=dtype)
    value = replace(ModelSpec.from_hf_config(config), dtype=dtype)
    for models in (job_models(actor), default_models(actor)):
        assert models["critic"] == value and models["reward"] == value and models["actor"] == actor


def _fits(schema: StateSchema, layout: Layout) -> bool:
    try:
        schema.validate(layout)
    except NereusConfigError:
        return False
    return True


def _ops(schema: StateSchema, rng: random.Random) -> list[Split | Merge]:
    """Every Split and Merge of the pairs of :data:`LAYOUTS` the schema admits, in several rank orders."""
    ops: dict[Split | Merge, None] = {}
    for a, b in itertools.product(LAYOUTS, LAYOUTS):
        if not (_fits(schema, a) and _fits(schema, b)):
            continue
        s = common_layout(a, b)
        if a != s:
            whole = Unit(a, range(a.size))
            ops[split("s", whole, s)] = None
            shuffled = rng.sample(whole.gpus, a.size)
            parts = tuple(Unit(s, shuffled[i : i + s.size]) for i in range(0, a.size, s.size))
            ops[Split("s", whole, parts)] = None
        if b != s:
            parts = split_units(Unit(b, range(b.size)), s)
            for order in (None, tuple(reversed(range(b.size))), tuple(rng.sample(range(b.size), b.size))):
                ops[merge("s", parts, b, ranks=order)] = None
        if a == b:
            ops[Merge("s", (Unit(a, range(a.size)),), Unit(a, rng.sample(range(a.size), a.size)))] = None
    return list(ops)


def _brain_bytes(geo, op: Split | Merge) -> Counter:
    """Bytes per (source, target) GPU of the brain's transfers for ``op``."""
    if isinstance(op, Split):
        tiles = tuple(tuple(op.source.gpus.index(g) for g in u.gpus) for u in op.targets)
        pattern, _ = split_pattern(geo, op.source.layout, op.targets[0].layout, tiles)
        transfers = placed(op.source.gpus, pattern)
    else:
        tiles = tuple(tuple(op.target.gpus.index(g) for g in u.gpus) for u in op.sources)
        pattern, _ = merge_pattern(geo, op.sources[0].layout, op.target.layout, tiles)
        transfers = placed(op.target.gpus, pattern)
    out: Counter = Counter()
    for t in transfers:
        out[(t.src_gpu, t.dst_gpu)] += t.bytes
    return out


def _wrong_holdings(schema: StateSchema, op: Split | Merge, plan) -> list[tuple]:
    """(rank, name) whose new shard is not exactly what it kept plus what it received, once each;
    and (rank, name, "step") where the AdamW step does not arrive exactly once for a new tensor."""
    held = {r: h for u in op.sources for r, h in unit_holdings(schema, u.layout, u.gpus).items()}
    needed = {r: h for u in op.targets for r, h in unit_holdings(schema, u.layout, u.gpus).items()}
    got: dict[tuple[int, str], list[tuple[int, int]]] = {}
    steps: Counter = Counter()
    for m in plan.moves:
        got.setdefault((m.dst, m.name), []).append((m.lo, m.hi))
        steps[(m.dst, m.name)] += m.with_step
    wrong = []
    for rank, names in needed.items():
        for name, (lo, hi) in names.items():
            parts = list(got.pop((rank, name), []))
            have = held[rank].get(name)
            if have is not None and max(lo, have[0]) < min(hi, have[1]):
                parts.append((max(lo, have[0]), min(hi, have[1])))
            parts.sort()
            ends = [lo] + [p[1] for p in parts]
            if [p[0] for p in parts] != ends[:-1] or ends[-1] != hi:
                wrong.append((rank, name))
            if steps[(rank, name)] != (have is None):
                wrong.append((rank, name, "step"))
    return wrong + sorted(got)  # anything left was received without being needed


@pytest.mark.parametrize("shape", list(SHAPES))
def test_body_moves_what_the_brain_prices_for_every_layout_pair(shape: str) -> None:
    config, dtype = SHAPES[shape]
    schema = StateSchema.of(config)
    schema = replace(schema, dtypes=(dtype,) * len(schema.names))
    model = replace(ModelSpec.from_hf_config(config), dtype=dtype)
    ops = _ops(schema, random.Random(shape))
    assert len(ops) >= 20, shape
    geos = {trains: geometry(model, trains) for trains in (False, True)}
    for op in ops:
        plan = reshard_plan(op, schema, True)  # the moves do not depend on ``trains``, their bytes do
        elements: Counter = Counter()
        for m in plan.moves:
            elements[(m.src, m.dst, m.name)] += element_count(schema, m.name, m.lo, m.hi)
        for trains, geo in geos.items():
            body: Counter = Counter()
            for (src, dst, name), n in elements.items():
                body[(src, dst)] += n * schema.element_bytes(name, trains)
            assert body == _brain_bytes(geo, op), (shape, trains, op)
        assert _wrong_holdings(schema, op, plan) == [], (shape, op)
