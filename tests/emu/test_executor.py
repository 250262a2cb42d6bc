"""emu.executor.execute_dag runs whole transition DAGs of a five-model-stage PPO job on four gloo ranks."""

import pytest

from tests.emu import executor_workers as workers

# (current, target, GPU ids reversed onto ranks)
PAIRS = [("A", "B", False), ("B", "A", True), ("C", "D", False), ("E", "F", False)]


@pytest.fixture(scope="module")
def results(dist4):
    return {pair: dist4.run(workers.run_pair, *pair) for pair in PAIRS}


def test_pairs_exercise_every_primitive_and_a_resource_edge(results):
    ops = {op for per_rank in results.values() for op, n in per_rank[0]["summary"]["counts"].items() if n}
    assert ops == {"split", "merge", "extend", "destroy"}
    for pair in PAIRS[:3]:
        summary = results[pair][0]["summary"]
        assert summary["resource_edges"] >= 1 and summary["with_resource_deps"], pair
    c_to_d = results[("C", "D", False)][0]["summary"]
    assert c_to_d["one_source_merges"] == 1 and c_to_d["overlapping_extends"] == 2


def test_every_model_stage_keeps_its_state_bit_for_bit(results):
    for pair, per_rank in results.items():
        first = per_rank[0]
        assert set(first["diffs"]) == set(workers.PLANS[pair[0]])
        for name, diff in first["diffs"].items():
            assert diff == [], (pair, name, diff[:3])
            assert first["replicas"][name] == workers.PLANS[pair[1]][name].dp, (pair, name)
        for rank, out in enumerate(per_rank):
            assert all(out["live_ok"].values()), (pair, rank, out["live_ok"])


def test_moved_units_compute_the_full_models_logits(results):
    for pair, per_rank in results.items():
        seen = set()
        for out in per_rank:
            for name, unit, err in out["errors"]:
                assert err <= 1e-5, (pair, name, unit, err)
                seen.add(name)
        assert seen == set(workers.PLANS[pair[1]]), pair


def test_measured_bytes_are_the_priced_bytes(results):
    """Per node and rank: payload bytes received = the brain's priced bytes into that GPU + counters + steps.

    Brain and EMU store the same bytes per parameter (``StateSchema.element_bytes``): here fp32,
    4 (inference), 3 x 4 = 12 (training: param, exp_avg, exp_avg_sq; no master copy at fp32;
    bf16 training would be 2 + 3 x 4 = 14, see test_mixed_precision). Beyond the priced pieces the EMU sends
    48 B of counters per receiving Extend position and, training, a 4-byte AdamW step per tensor
    a rank first receives (``extra``).
    """
    for pair, per_rank in results.items():
        for rank, out in enumerate(per_rank):
            for node_id, op, trains, brain, brain_bpp, body_bpp, measured, extra in out["rows"]:
                assert brain_bpp == body_bpp, (trains, brain_bpp, body_bpp)
                assert measured - extra == brain, (pair, rank, node_id, op, trains, measured, extra, brain)
            assert [o.measured_bytes for o in out["local"]] == [row[6] for row in out["rows"]]
    moved = [row for per_rank in results.values() for out in per_rank for row in out["rows"] if row[3]]
    assert any(row[2] for row in moved) and any(not row[2] for row in moved)  # training and inference bytes


def test_reduced_report_sums_bytes_and_times_members(results):
    for pair, per_rank in results.items():
        summary = per_rank[0]["summary"]
        reduced = per_rank[0]["reduced"]
        assert all(out["reduced"] == reduced for out in per_rank), pair  # every rank gets the same view
        assert [o.predicted_bytes for o in reduced] == summary["node_bytes"]
        for i, obs in enumerate(reduced):
            assert obs.node_id == i
            assert obs.measured_bytes == sum(out["local"][i].measured_bytes for out in per_rank)
            members = per_rank[0]["members"][i]
            slowest = max(per_rank[r]["local"][i].seconds for r in members)
            assert obs.seconds == slowest > 0
            assert 0 < per_rank[0]["fastest"][i].seconds <= obs.seconds


def test_a_dag_for_other_live_units_fails_everywhere_before_moving(dist4):
    for message, same, diffs in dist4.run(workers.stale_registry):
        assert message is not None and "node #0" in message and "not a live unit" in message
        assert all(same.values())
        assert all(d == [] for d in diffs.values())


def test_one_source_merge_is_a_re_ranking_only():
    from nereus_lightning.emu import Merge, Unit, validate_op
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.spec.errors import NereusConfigError

    source = Unit(Layout(2, 1), (2, 3))
    validate_op(Merge("critic_infer", (source,), Unit(Layout(2, 1), (3, 2))))
    for target in (Unit(Layout(2, 1), (3, 1)), Unit(Layout(1, 2), (3, 2))):
        with pytest.raises(NereusConfigError, match="only re-ranks onto the same layout and ranks"):
            validate_op(Merge("critic_infer", (source,), target))


def test_independent_nodes_on_one_rank_are_in_flight_together(results):
    """E -> F: rank 0 sends in three independent nodes (one a batched Extend of two lanes); the
    executor issues all of them before waiting for any, and the state still arrives bit for bit
    (checked for every pair above)."""
    per_rank = results[("E", "F", False)]
    assert sorted(per_rank[0]["widths"]) == [1, 1, 2]
    rank0 = per_rank[0]["in_flight"]
    assert len(rank0) == 3 and max(n for _, n, _ in rank0) == 3, rank0
    assert any(lanes == 2 for _, _, lanes in rank0)
    # Every other rank receives in exactly the nodes that target it.
    assert [len(out["in_flight"]) for out in per_rank[1:]] == [1, 2, 2]


def test_calibration_observations_name_each_moving_node_by_op_and_link(results):
    """One (name, predicted, measured) per node that moved bytes between GPUs; cpu4 is one machine."""
    for pair, per_rank in results.items():
        out = per_rank[0]
        obs = out["calibration"]
        assert len(obs) >= out["moving_nodes"] > 0, pair
        for name, predicted, measured in obs:
            kind, op, link = name.split("/")
            assert kind == "transition" and op in {"split", "merge", "extend"} and link in {"intra", "local"}
            assert predicted >= 0 and measured > 0, (pair, name, predicted, measured)
