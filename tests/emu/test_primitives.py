"""State preservation and byte counts of Split / Merge / Extend / Destroy on 4 gloo ranks."""

import pytest

from tests.emu import workers


@pytest.mark.parametrize("kind", ["llama", "gqa_tied", "qwen2"])
def test_chain_preserves_logical_state_bit_for_bit(dist4, kind):
    results = dist4.run(workers.chain, kind)
    initial, steps, reports, live = results[0]
    assert initial == []  # the gathered state is the model's own tensors
    assert [k for k, _ in steps] == [
        "split",
        "destroy",
        "extend",
        "split",
        "split",
        "merge",
        "merge",
        "merge",
    ]
    for kind_, diff in steps:
        assert diff == [], f"{kind_} changed the state: {diff[:3]}"
    assert len(live) == 1


@pytest.mark.parametrize("kind", ["llama", "gqa_tied"])
def test_split_then_merge_back_is_exact_and_merge_moves_nothing(dist4, kind):
    per_rank = dist4.run(workers.pp_and_tp_pairs, kind)
    for big, small, mid, after, ranks, _ in per_rank[0]:
        assert mid == [] and after == [], (big, small, mid, after)
        assert ranks == (0, 1, 2, 3)  # the cheapest order is the original one
    assert all(row[5] == 0 for res in per_rank for row in res), "merging full replicas back moved bytes"


@pytest.mark.parametrize("kind", ["gqa_tied", "qwen2"])
def test_models_built_on_moved_shards_compute_the_same_logits(dist4, kind):
    for rows in dist4.run(workers.forward_after_transitions, kind):
        assert [label for label, _, _ in rows] == ["start", "split", "merge"]
        for label, unit, err in rows:
            assert err <= 1e-5, (label, unit, err)


def test_ranks_outside_an_op_need_not_call_it(dist4):
    results = dist4.run(workers.disjoint_ops_without_bystanders)
    reports = [r for r, _ in results]
    assert [r.kind for r in reports] == ["extend", "extend", "split", "split"]
    assert reports[0].payload_sent > 0 and reports[2].payload_sent > 0
    assert results[0][1] == (2, 2, [], True)
