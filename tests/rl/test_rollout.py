"""Rollout engine (seeded per-sample sampling, greedy), forward passes and reward scorers on a tiny Llama."""

from __future__ import annotations

import copy
import functools
import importlib.util
import math

import pytest
import torch

from nereus_lightning.engines.base import RolloutEngine, SeededGumbel, response_mask_from_ids, sample_seeds
from nereus_lightning.engines.hf import HFGenerateEngine
from nereus_lightning.models.pipeline import position_ids_from_mask
from nereus_lightning.rl.forward import response_log_probs, response_values
from nereus_lightning.rl.reference_loop import tiny_llama_config
from nereus_lightning.rl.reward import FunctionReward, ModelReward, make_scorer
from nereus_lightning.rl.tasks import repeat_reward
from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.spec.errors import NereusConfigError

TOK = ByteTokenizer()


@functools.lru_cache(maxsize=1)
def _actor():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        tiny_llama_config(hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64)
    ).eval()


def _engine():
    return HFGenerateEngine(_actor(), TOK.eos_token_id, TOK.pad_token_id)


def _prompts(texts):
    enc = TOK(texts)
    return enc["input_ids"], enc["attention_mask"]


def test_response_mask_covers_first_eos_only():
    ids = torch.tensor([[5, 258, 7], [258, 258, 1], [1, 2, 3]])
    assert response_mask_from_ids(ids, 258).tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1]])).tolist() == [[0, 0, 0, 1, 2]]


def test_greedy_matches_a_plain_argmax_loop_on_left_padded_prompts():
    ids, mask = _prompts(["3*a=", "12*b=x"])
    out = _engine().generate(ids, mask, max_new_tokens=4, do_sample=False)
    assert isinstance(_engine(), RolloutEngine)
    assert out.response_ids.shape == (2, 4) and torch.equal(out.prompt_ids, ids)
    for row in range(2):  # one unpadded row at a time, full forward each token, no cache
        seq = ids[row, mask[row].bool()].unsqueeze(0)
        for t in range(4):
            if out.response_mask[row, t] == 0:
                assert out.response_ids[row, t] == TOK.pad_token_id
                continue
            nxt = _actor()(input_ids=seq).logits[0, -1].argmax()
            assert out.response_ids[row, t] == nxt
            seq = torch.cat([seq, nxt.view(1, 1)], dim=-1)


def test_sampling_depends_on_the_sample_seed_not_the_batch():
    ids, mask = _prompts(["2*a=", "31*b=", "7*a="])
    seeds = sample_seeds(seed=3, step=5, indices=[10, 11, 12])
    assert seeds == sample_seeds(3, 5, torch.tensor([10, 11, 12])) and seeds != sample_seeds(
        3, 6, [10, 11, 12]
    )
    engine = _engine()
    together = engine.generate(ids, mask, 6, sample_seeds=seeds)
    again = engine.generate(ids, mask, 6, sample_seeds=seeds)
    assert torch.equal(together.response_ids, again.response_ids)
    alone_ids, alone_mask = _prompts(["31*b="])  # no left padding when alone
    alone = engine.generate(alone_ids, alone_mask, 6, sample_seeds=seeds[1:2])
    assert torch.equal(alone.response_ids[0], together.response_ids[1])
    other = engine.generate(ids, mask, 6, sample_seeds=sample_seeds(4, 5, [10, 11, 12]))
    assert not torch.equal(other.response_ids, together.response_ids)
    top1 = engine.generate(ids, mask, 6, top_k=1, sample_seeds=seeds)
    assert torch.equal(top1.response_ids, engine.generate(ids, mask, 6, do_sample=False).response_ids)


def test_seeded_gumbel_samples_the_softmax():
    # two tokens with probabilities .7 / .3 (temperature 2 on logits 2 ln .7, 2 ln .3): 4000 seeds
    proc = SeededGumbel(
        list(range(4000)), prompt_len=1, max_new_tokens=1, temperature=2.0, top_k=0, top_p=1.0
    )
    logits = torch.tensor([2 * math.log(0.7), 2 * math.log(0.3)]).expand(4000, 2)
    picks = proc(torch.zeros(4000, 1, dtype=torch.long), logits).argmax(-1).float()
    assert abs((1 - picks.mean()).item() - 0.7) < 0.03  # 4 sigma
    # top_p = .5 keeps only the most likely token
    proc = SeededGumbel(list(range(50)), 1, 1, 1.0, 0, 0.5)
    assert proc(torch.zeros(50, 1, dtype=torch.long), logits[:50]).argmax(-1).eq(0).all()


def test_engine_rejects_bad_input():
    ids, mask = _prompts(["2*a="])
    with pytest.raises(NereusConfigError, match="sample_seeds"):
        _engine().generate(ids, mask, 3)
    with pytest.raises(NereusConfigError, match="temperature"):
        _engine().generate(ids, mask, 3, temperature=0.0, sample_seeds=[1])
    with pytest.raises(NereusConfigError, match="generate"):
        HFGenerateEngine(torch.nn.Linear(2, 2), 258, 256)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm installed")
def test_vllm_engine_says_how_to_install():
    from nereus_lightning.engines.vllm_engine import build_engine

    with pytest.raises(NereusConfigError, match=r"nereus-lightning\[vllm\]"):
        build_engine(tiny_llama_config(), [[0]])


def test_response_log_probs_ignore_left_padding_and_match_manual():
    ids, mask = _prompts(["3*a=", "12*b="])
    response = torch.tensor([[97, 97, 258], [98, 256, 256]])
    rmask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    lp, ent = response_log_probs(_actor(), ids, mask, response, rmask, with_entropy=True)
    assert lp.shape == ent.shape == (2, 3)
    # row 0 has one pad slot on the left: recompute without it
    seq = torch.cat([ids[0, 1:], response[0]]).unsqueeze(0)
    logp = torch.log_softmax(_actor()(input_ids=seq).logits[0], -1)
    prompt_len = ids.shape[1] - 1
    manual = [logp[prompt_len - 1 + t, response[0, t]].item() for t in range(3)]
    assert lp[0].tolist() == pytest.approx(manual, abs=1e-5)
    hot, _ = response_log_probs(_actor(), ids, mask, response, rmask, temperature=2.0)
    assert not torch.allclose(hot, lp)


def test_values_and_reward_scorers():
    from transformers import LlamaForTokenClassification

    config = tiny_llama_config(hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64)
    config.num_labels = 1
    torch.manual_seed(1)
    critic = LlamaForTokenClassification(config).eval()
    ids, mask = _prompts(["3*a=", "1*b="])
    response = torch.tensor([[97, 97, 258], [98, 258, 256]])
    rmask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    values = response_values(critic, ids, mask, response, rmask)
    assert values.shape == (2, 3)
    # as a reward model, the score is the value head at the last valid token of prompt + response
    scores = ModelReward(critic)(ids, mask, response, rmask)
    full_ids, full_mask = torch.cat([ids, response], -1), torch.cat([mask, rmask], -1)
    logits = critic(
        input_ids=full_ids, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
    ).logits
    assert scores.tolist() == pytest.approx([logits[0, -1, 0].item(), logits[1, -2, 0].item()], abs=1e-6)
    assert ModelReward(lambda input_ids, attention_mask: attention_mask.sum(-1).float())(
        ids, mask, response, rmask
    ).tolist() == [8.0, 7.0]
    # a text function sees decoded prompts (without bos / padding) and responses (up to eos)
    text = FunctionReward(repeat_reward, TOK)(ids, mask, response, rmask)
    assert text.tolist() == pytest.approx([2 / 3, 1.0])
    assert isinstance(make_scorer(critic), ModelReward) and isinstance(
        make_scorer(repeat_reward, TOK), FunctionReward
    )
    with pytest.raises(NereusConfigError, match="tokenizer"):
        make_scorer(repeat_reward)
    with pytest.raises(NereusConfigError, match="callable"):
        make_scorer(3)


def test_forward_engine_matches_hf_generate():
    from nereus_lightning.engines.hf import ForwardEngine

    def logits_of(model):
        def logits(input_ids, attention_mask, position_ids):
            return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits

        return logits

    ids, mask = _prompts(["2*a=", "31*b=", "7*a="])
    seeds = sample_seeds(1, 0, [0, 1, 2])
    for kwargs in (dict(sample_seeds=seeds, temperature=0.7, top_k=50), dict(do_sample=False)):
        a = ForwardEngine(logits_of(_actor()), TOK.eos_token_id, TOK.pad_token_id).generate(
            ids, mask, 5, **kwargs
        )
        b = _engine().generate(ids, mask, 5, **kwargs)
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)


def test_checkpoint_generation_defaults_do_not_leak_into_sampling():
    from transformers import GenerationConfig

    from nereus_lightning.engines.hf import ForwardEngine

    model = copy.deepcopy(_actor())
    with torch.no_grad():
        model.model.norm.weight.zero_()  # all logits 0: greedy repeats token 0 unless something bans repeats
    model.generation_config = GenerationConfig(
        do_sample=True, top_k=3, temperature=0.3, repetition_penalty=3.0, no_repeat_ngram_size=1
    )
    ids, mask = _prompts(["2*a="])
    out = HFGenerateEngine(model, TOK.eos_token_id, TOK.pad_token_id).generate(ids, mask, 4, do_sample=False)
    assert out.response_ids.tolist() == [[0, 0, 0, 0]]
    seeds = sample_seeds(0, 0, [0])
    hf = HFGenerateEngine(model, TOK.eos_token_id, TOK.pad_token_id).generate(
        ids, mask, 4, sample_seeds=seeds
    )
    plain = ForwardEngine(
        lambda i, m, p: model(input_ids=i, attention_mask=m, position_ids=p).logits,
        TOK.eos_token_id,
        TOK.pad_token_id,
    ).generate(ids, mask, 4, sample_seeds=seeds)
    assert torch.equal(hf.response_ids, plain.response_ids)


def test_forward_engine_stops_rows_at_eos_and_pads_after():
    from nereus_lightning.engines.hf import ForwardEngine

    def logits(input_ids, attention_mask, position_ids):
        out = torch.zeros(*input_ids.shape, TOK.vocab_size)
        out[..., 97] = 1.0
        stop = (position_ids[:, -1] >= 5) & (
            input_ids[:, 1] == TOK.bos_token_id
        )  # row 0 is left-padded by one
        out[stop, -1, TOK.eos_token_id] = 2.0
        return out

    ids, mask = _prompts(["2*a=", "13*a="])
    out = ForwardEngine(logits, TOK.eos_token_id, TOK.pad_token_id).generate(ids, mask, 5, do_sample=False)
    assert out.response_ids.tolist() == [[97, 258, 256, 256, 256], [97] * 5]
    assert out.response_mask.tolist() == [[1, 1, 0, 0, 0], [1] * 5]
