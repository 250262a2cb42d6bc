"""RolloutBatch split / concat and the deterministic re-partition between DP layouts."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.rl.batch import RolloutBatch, dp_slice
from nereus_lightning.spec.errors import NereusConfigError


def _batch(indices, response_width=3, prompt_width=2):
    n = len(indices)
    idx = torch.tensor(indices)
    return RolloutBatch(
        prompt_ids=idx.unsqueeze(-1).repeat(1, prompt_width),
        prompt_mask=torch.ones(n, prompt_width, dtype=torch.long),
        response_ids=idx.unsqueeze(-1).repeat(1, response_width) + 100,
        response_mask=torch.ones(n, response_width, dtype=torch.long),
        sample_index=idx,
        group_index=idx // 2,
        scores=idx.float(),
    )


def test_dp_slice_blocks():
    assert [dp_slice(10, 3, r) for r in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert [dp_slice(8, 4, r) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(NereusConfigError, match="rank"):
        dp_slice(8, 4, 4)


def test_split_and_shard():
    b = _batch(list(range(7)))
    parts = b.split(3)
    assert [p.sample_index.tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert b.shard(2, 1).scores.tolist() == [4.0, 5.0, 6.0]
    assert len(b.select([6, 0])) == 2 and b.select([6, 0]).group_index.tolist() == [3, 0]


def test_concat_sorts_by_index_and_pads_widths():
    short = _batch([5, 1], response_width=2, prompt_width=1)
    long = _batch([0, 3], response_width=4, prompt_width=3)
    whole = RolloutBatch.concat([short, long])
    assert whole.sample_index.tolist() == [0, 1, 3, 5]
    # responses right-padded, prompts left-padded, masks zero on the padding
    assert whole.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert whole.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1]]
    assert whole.response_ids[1].tolist()[:2] == [101, 101]
    with pytest.raises(NereusConfigError, match="different fields"):
        RolloutBatch.concat([short, RolloutBatch(**{**long.tensors(), "values": torch.zeros(2, 4)})])


def test_repartition_between_dp_degrees_is_by_global_index():
    whole = _batch(list(range(12)))
    four_way = [whole.shard(4, r) for r in range(4)]
    # pieces may arrive in any order: the result depends on the indices only
    three_way = RolloutBatch.repartition(list(reversed(four_way)), 3)
    assert [p.sample_index.tolist() for p in three_way] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    back = RolloutBatch.repartition(three_way, 4)
    for a, b in zip(back, four_way, strict=False):
        assert all(torch.equal(a.tensors()[k], b.tensors()[k]) for k in a.tensors())


def test_rows_must_agree():
    b = _batch([0, 1])
    with pytest.raises(NereusConfigError, match="RolloutBatch.values"):
        RolloutBatch(**{**b.tensors(), "values": torch.zeros(3, 3)})


def test_the_policy_version_of_each_sample_travels_with_it():
    from nereus_lightning.engines.base import RolloutOutput, response_rows, version_tensor

    a, b = _batch([5, 1]), _batch([0, 3])
    a.policy_version, b.policy_version = torch.tensor([7, 7]), torch.tensor([6, 6])
    whole = RolloutBatch.concat([a, b])
    assert whole.policy_version.tolist() == [6, 7, 6, 7]  # sorted by sample index with the rest
    assert [p.policy_version.tolist() for p in RolloutBatch.repartition([a, b], 2)] == [[6, 7], [6, 7]]
    # An engine's rows: response ids up to the mask, each with its version; unknown versions stay unknown.
    out = RolloutOutput(
        torch.ones(2, 1, dtype=torch.long),
        torch.ones(2, 1, dtype=torch.long),
        torch.tensor([[4, 9, 0], [5, 0, 0]]),
        torch.tensor([[1, 1, 0], [1, 0, 0]]),
        policy_version=torch.tensor([3, 3]),
    )
    assert response_rows(out) == [([4, 9], 3, None), ([5], 3, None)]
    out.policy_version = None
    assert response_rows(out) == [([4, 9], None, None), ([5], None, None)]
    assert version_tensor([3, 3]).tolist() == [3, 3] and version_tensor([3, None]) is None
