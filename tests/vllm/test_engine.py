"""The vLLM engine against transformers on the same weights: weights in and back out, greedy tokens,
log-probs.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import VLLM

pytestmark = [*VLLM, pytest.mark.distributed]


def test_engine_holds_the_shards_and_generates_what_transformers_does(dist2_vllm, job):
    from tests.vllm.helpers import engine_against_hf

    per_rank = dist2_vllm.run(engine_against_hf, job["model"], ((2, False), (1, False), (2, True)))
    assert (
        "lm_head.weight" in per_rank[0]["tp1"]["names"]
        and "lm_head.weight" not in per_rank[0]["tp2-tied"]["names"]
    )
    for out in per_rank:
        for tp, got in out.items():
            # The shards went in through vLLM's reload API and come back through its kernels unchanged.
            assert got["read_back"] and got["differ"] == [], (tp, got["differ"])
            # fp32: greedy decoding is transformers' token for token; sampled tokens score as rl.forward does.
            assert got["greedy_equal"], (tp, got["greedy"])
            assert got["sampled_tokens"] > 0 and got["log_prob_error"] < 1e-4, (tp, got["log_prob_error"])
            # A sample depends on its seed only, not on the batch it is generated in (any DP split).
            assert got["split_batches_equal"]
            assert got["policy_version"] == 5
    # The TP ranks of one replica see the same responses; TP 2 samples what TP 1 does.
    assert per_rank[0]["tp2"] == per_rank[1]["tp2"] and per_rank[0]["tp2-tied"] == per_rank[1]["tp2-tied"]
    assert per_rank[0]["tp2"]["sampled"] == per_rank[0]["tp1"]["sampled"]
