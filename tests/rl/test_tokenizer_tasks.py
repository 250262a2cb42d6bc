"""Byte tokenizer, the repeat task's reward and its resumable prompt sampler."""

from __future__ import annotations

import os

import pytest
import torch

from nereus_lightning.rl.tasks import (
    PromptSampler,
    RepeatTask,
    parse_repeat_prompt,
    repeat_prompt,
    repeat_reward,
)
from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.spec.errors import NereusConfigError


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    assert tok.vocab_size == 264 and len(tok) == 264  # 259 rounded up to a multiple of 8
    assert ByteTokenizer(pad_vocab_to=1).vocab_size == 259
    assert tok.encode("Ab", add_bos=True, add_eos=True) == [257, 65, 98, 258]
    assert tok.decode([257, 104, 105, 258, 120]) == "hi"  # stops at eos, drops bos
    assert tok.decode([104, 258, 120], stop_at_eos=False) == "hx"
    assert tok.decode([257, 104], skip_special_tokens=False) == "<bos>h"
    text = "héllo*3="
    assert tok.decode(tok.encode(text)) == text
    assert tok.batch_decode(torch.tensor([[97, 258], [98, 256]])) == ["a", "b"]


def test_byte_tokenizer_padding():
    tok = ByteTokenizer()
    ids, mask = tok.pad([[1, 2, 3], [4]], side="left")
    assert ids.tolist() == [[1, 2, 3], [256, 256, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = tok.pad([[1, 2, 3], [4]], side="right", length=4)
    assert ids.tolist() == [[1, 2, 3, 256], [4, 256, 256, 256]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    batch = tok(["2*a=", "10*b="])
    assert batch["input_ids"][0].tolist() == [256, 257, 50, 42, 97, 61]
    assert batch["attention_mask"].sum(-1).tolist() == [5, 6]
    with pytest.raises(NereusConfigError, match="padding_side"):
        tok.pad([[1]], side="middle")


def test_repeat_reward_by_hand():
    assert repeat_prompt("b", 4) == "4*b=" and parse_repeat_prompt("12*a=") == ("a", 12)
    prompts = ["4*b="] * 4
    # prefix / count: "bbbb" 4/4, "bbx" 2/4, "xbbb" 0/4, "bbbbbb" capped at 4/4
    assert repeat_reward(prompts, ["bbbb", "bbx", "xbbb", "bbbbbb"]) == [1.0, 0.5, 0.0, 1.0]
    # with eos: (prefix + exact) / (count + 1): exact 5/5, overshoot 4/5, short 3/5
    assert repeat_reward(prompts[:3], ["bbbb", "bbbbb", "bbb"], require_eos=True) == [1.0, 0.8, 0.6]
    with pytest.raises(NereusConfigError, match="<count>\\*<symbol>="):
        repeat_reward(["hello"], ["x"])


def test_sampler_is_seeded_resumable_and_layout_free():
    task = RepeatTask(alphabet="abc", start_count=3, count_spread=1)
    a = PromptSampler(task, seed=7)
    first = a.next_prompts(5)
    assert [p.index for p in first] == [0, 1, 2, 3, 4]
    assert all(parse_repeat_prompt(p.text)[1] in (2, 3) for p in first)
    state = a.state_dict()
    rest = a.next_prompts(4)
    b = PromptSampler(task, seed=7)
    b.load_state_dict(state)
    assert b.next_prompts(4) == rest
    # prompt i depends on (seed, i) only: drawing in two pieces equals drawing at once
    c = PromptSampler(task, seed=7)
    assert c.next_prompts(3) + c.next_prompts(6) == first + rest
    assert PromptSampler(task, seed=8).next_prompts(9) != first + rest
    with pytest.raises(NereusConfigError, match="seed"):
        PromptSampler(task, seed=8).load_state_dict(state)


def test_curriculum_raises_count_after_patience_and_grows_budget():
    s = PromptSampler(RepeatTask(start_count=2, max_count=3, raise_at=0.8, patience=2))
    assert s.max_new_tokens == 2
    assert s.observe(0.9) is False
    assert s.observe(0.7) is False  # streak broken
    assert s.observe(0.9) is False
    assert s.observe(0.8) is True and s.count == 3 and s.max_new_tokens == 3
    assert s.observe(1.0) is False and s.observe(1.0) is False  # capped at max_count
    assert s.state_dict() == {"seed": 0, "position": 0, "count": 3, "streak": 2}
    eos = PromptSampler(RepeatTask(start_count=4, require_eos=True, slack=2))
    assert eos.max_new_tokens == 4 + 1 + 2


def test_repeat_task_rejects_bad_knobs():
    with pytest.raises(NereusConfigError, match="task.alphabet"):
        RepeatTask(alphabet="a*")
    with pytest.raises(NereusConfigError, match="task.start_count"):
        RepeatTask(start_count=5, max_count=4)
    with pytest.raises(NereusConfigError, match="task.count_spread"):
        RepeatTask(start_count=2, count_spread=2)


def test_reward_function_scores_in_a_worker_pool_like_inline(tmp_path):
    from nereus_lightning.rl.reward_function import RewardFunction, RewardInput, RewardSpec

    path = tmp_path / "reward.py"
    path.write_text(
        "import os\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str == 'boom':\n"
        "        raise ValueError('no score for boom')\n"
        "    return {'score': float(solution_str == ground_truth), 'pid': float(os.getpid())}\n"
    )
    items = [RewardInput(i, "src", s, "7") for i, s in enumerate(["7", "8", "boom", "7"])]
    inline = RewardFunction(RewardSpec(str(path)))(items)
    pool = RewardFunction(RewardSpec(str(path)), num_workers=2)
    pooled = pool(items)
    pool.close()
    assert (
        [r.score for r in inline if r.error is None]
        == [r.score for r in pooled if r.error is None]
        == [1.0, 0.0, 1.0]
    )
    assert (
        "sample 2" in pooled[2].error
        and "'src'" in pooled[2].error
        and "no score for boom" in pooled[2].error
    )
    assert {r.metrics["pid"] for r in pooled if r.error is None} != {float(os.getpid())}  # scored in workers
