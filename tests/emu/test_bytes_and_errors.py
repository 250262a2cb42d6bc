"""Bytes moved by each primitive vs the minimum its definition implies; bad input refused before any move."""

from nereus_lightning.emu import Counters
from tests.emu import workers


def test_primitives_move_the_minimum_bytes(dist4):
    ranks = dist4.run(workers.byte_counts)
    # Extend: the source ranks send their state once to the new replica; targets receive exactly it.
    ext = [r["extend"] for r in ranks]
    assert sum(e["report"].payload_sent for e in ext) == sum(e["own"] for e in ext) + 2 * Counters.size() * 8
    assert [e["got"] for e in ext[2:]] == [e["own"] for e in ext[:2]]
    for e in ext[:2]:
        assert e["report"].buffers_sent == 1  # one contiguous buffer per peer
        assert e["report"].payload_sent <= e["report"].sent_bytes < e["report"].payload_sent + 16 * 200
    assert sum(e["report"].sent_bytes for e in ext) == sum(e["report"].received_bytes for e in ext)
    # Extend to three new replicas at once: three copies, nothing more.
    e3 = ranks[0]["extend3"]
    assert e3["report"].payload_sent == 3 * (e3["own"] + Counters.size() * 8)
    assert e3["report"].peers == (1, 2, 3)
    # Split: each rank receives exactly what it lacks; what is sent is what is received.
    for case in ("split_tp", "split_pp_uneven", "split_both"):
        rows = [r[case] for r in ranks]
        assert [row["report"].payload_received for row in rows] == [row["lacked"] for row in rows], case
        assert sum(row["report"].payload_sent for row in rows) == sum(row["lacked"] for row in rows) > 0
        assert sum(row["report"].sent_bytes for row in rows) == sum(
            row["report"].received_bytes for row in rows
        )
    # Merge: the chosen order moves nothing; a forced order moves exactly what is missing.
    chosen = [r["merge_chosen"] for r in ranks]
    assert all(row["report"].sent_bytes == 0 and row["report"].received_bytes == 0 for row in chosen)
    assert chosen[0]["ranks"] == (0, 1, 2, 3)
    forced = [r["merge_forced"] for r in ranks]
    assert [row["report"].payload_received for row in forced] == [row["lacked"] for row in forced]
    assert sum(row["lacked"] for row in forced) > 0


def test_bad_input_is_refused_before_any_state_moves(dist4):
    results = dist4.run(workers.bad_inputs)
    out = results[0]
    assert "num_heads=4" in out["tp_heads"]
    assert "num_kv_heads=2" in out["tp_kv_heads"]
    assert "num_kv_heads=2" in out["merge_kv_heads"]
    assert out["merge_kv_heads_intact"] is True and out["merge_kv_heads_state"] == []
    assert "num_layers=2" in out["pp_layers"]
    assert "split.layout.tp" in out["split_factor"]
    assert "actor_train" in out["overlap"] and "[1]" in out["overlap"]
    assert "actor_train" in out["overlap_create"]
    assert out["overlap_live"] == ["TP1xPP1@[2]"]
    assert "last copy" in out["last_copy"]
    assert out["last_copy_live"] == ["TP1xPP1@[2]"]
    assert out["colocated_ok"] is None and out["destroy_ok"] is None
    assert out["final_live"] == ["TP1xPP1@[1]"]
    for r in results:  # every rank refused the same ops with the same words
        assert {k: v for k, v in r.items() if isinstance(v, str)} == {
            k: v for k, v in out.items() if isinstance(v, str)
        }
