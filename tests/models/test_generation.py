"""transformers `generate` over a sharded replica (``ShardedGenerator``) equals it on the unsharded model."""

from __future__ import annotations

import functools

import pytest
import torch

from nereus_lightning.engines.base import sample_seeds
from nereus_lightning.engines.hf import HFGenerateEngine
from nereus_lightning.models import ReplicaComm, ShardedCausalLM
from nereus_lightning.models.generation import ShardedGenerator
from nereus_lightning.plan.layout import Layout
from nereus_lightning.rl.forward import response_log_probs
from nereus_lightning.testing.tiny import my_replica, tiny_model

EOS = 255
LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def _record_length(seen: list[int], module, args, kwargs) -> None:  # noqa: ANN001
    seen.append(kwargs["input_ids"].shape[1])


def _prompts(index: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(10 + index)  # replicas see different prompts
    ids = torch.randint(0, 250, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    ids[0, :3] = 0
    return ids, mask, sample_seeds(0, 1, [3 * index + i for i in range(3)])


def _generate_on_replicas(rank: int, world: int, kind: str) -> dict[str, object]:
    model = tiny_model(kind)
    tied = bool(model.config.tie_word_embeddings)
    out: dict[str, object] = {}
    for tp, pp in LAYOUTS:
        index, comm = my_replica(rank, world, Layout(tp, pp), tied)
        generator = ShardedGenerator(ShardedCausalLM.from_model(model, comm))
        seen: list[int] = []
        generator.register_forward_pre_hook(functools.partial(_record_length, seen), with_kwargs=True)
        ids, mask, seeds = _prompts(index)
        want = HFGenerateEngine(model, EOS, 0).generate(ids, mask, 10, sample_seeds=seeds)
        got = HFGenerateEngine(generator, EOS, 0).generate(ids, mask, 10, sample_seeds=seeds)
        decode_lengths = sorted(set(seen[1:]))  # after the prefill: one new token per forward
        greedy = HFGenerateEngine(generator, EOS, 0).generate(ids, mask, 6, do_sample=False)
        greedy_want = HFGenerateEngine(model, EOS, 0).generate(ids, mask, 6, do_sample=False)
        scored = (want.prompt_ids, want.prompt_mask, want.response_ids, want.response_mask)
        with torch.no_grad():
            lp_want, _ = response_log_probs(model, *scored)
            lp_got, _ = response_log_probs(generator, *scored)
        key = f"tp{tp}pp{pp}"
        out[f"{key}/same_tokens"] = torch.equal(want.response_ids, got.response_ids) and torch.equal(
            greedy.response_ids, greedy_want.response_ids
        )
        out[f"{key}/lp_err"] = float((lp_want - lp_got).abs().max())
        out[f"{key}/decode_lengths"] = decode_lengths
    return out


@pytest.mark.parametrize("kind", ["gqa_tied", "mistral"])
def test_sharded_generate_matches_unsharded(dist4, kind: str) -> None:
    for rank, out in enumerate(dist4.run(_generate_on_replicas, kind)):
        for tp, pp in LAYOUTS:
            key = f"tp{tp}pp{pp}"
            assert out[f"{key}/same_tokens"], f"rank {rank} {kind} {key}: responses differ"
            assert out[f"{key}/lp_err"] <= 1e-5, f"rank {rank} {kind} {key}: {out[f'{key}/lp_err']}"
            assert out[f"{key}/decode_lengths"] == [1], f"rank {rank} {kind} {key}: KV cache not used"


def test_single_rank_generator_needs_no_process_group() -> None:
    model = tiny_model("qwen3")
    generator = ShardedGenerator(ShardedCausalLM.from_model(model, ReplicaComm.single()))
    ids, mask, seeds = _prompts(0)
    want = HFGenerateEngine(model, EOS, 0).generate(ids, mask, 8, sample_seeds=seeds)
    got = HFGenerateEngine(generator, EOS, 0).generate(ids, mask, 8, sample_seeds=seeds)
    assert torch.equal(want.response_ids, got.response_ids)
    assert generator.config is not model.config  # the adapter never edits the unit's config


def test_without_a_per_stage_cache_generate_recomputes_and_agrees(monkeypatch) -> None:
    # Older transformers cannot size masks by a stage's own cache layers: decoding then re-runs
    # the whole sequence each token, with the same tokens.
    import nereus_lightning.models.generation as generation

    monkeypatch.setattr(generation, "supports_kv_cache", lambda: False)
    model = tiny_model("llama")
    generator = ShardedGenerator(ShardedCausalLM.from_model(model, ReplicaComm.single()))
    seen: list[int] = []
    generator.register_forward_pre_hook(functools.partial(_record_length, seen), with_kwargs=True)
    ids, mask, seeds = _prompts(1)
    want = HFGenerateEngine(model, EOS, 0).generate(ids, mask, 5, sample_seeds=seeds)
    got = HFGenerateEngine(generator, EOS, 0).generate(ids, mask, 5, sample_seeds=seeds)
    assert torch.equal(want.response_ids, got.response_ids)
    assert seen[:3] == [7, 8, 9]  # the whole sequence every token
