"""torch.distributed.checkpoint as an independent oracle for Split and Merge."""

from tests.emu import workers


def test_dcp_reshard_equals_split_and_merge(dist4, tmp_path):
    per_rank = dist4.run(workers.dcp_oracle, str(tmp_path))
    labels = [row[0] for row in per_rank[0]]
    assert labels == ["split_tp", "split_all", "split_pp_uneven", "merge_tp4", "merge_pp4", "merge_tp2pp2"]
    for rank, rows in enumerate(per_rank):
        for label, unit, count, same_keys, bad, counters_equal in rows:
            assert count > 0 and same_keys, (rank, label, unit)
            assert bad == [], f"rank {rank} {label} {unit}: shards differ from DCP's: {bad[:4]}"
            assert counters_equal, (rank, label)
