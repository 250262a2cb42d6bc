"""The EMU state backend moves model-stage state with the transition DAG executor."""

from __future__ import annotations

import pytest

from tests.lightning.helpers import emu_transitions

pytestmark = pytest.mark.distributed


def test_tp_pp_changes_run_a_transition_dag_and_keep_the_logical_state(dist4):
    per_rank = dist4.run(emu_transitions)
    first = per_rank[0]
    assert all(t["mode"] == "dag" for t in first["transitions"]), first["transitions"]
    kinds = {k for t in first["transitions"] for k, n in t["counts"].items() if n}
    assert kinds == {"split", "merge", "extend", "destroy"}, kinds
    assert all(t["bytes"] > 0 for t in first["transitions"])
    assert len(first["diffs"]) == 2
    for diffs in first["diffs"]:
        assert set(diffs) >= {"actor_gen", "actor_train", "critic_train", "ref_infer"}
        assert all(d == [] for d in diffs.values()), diffs

    # Every rank saw the same transitions and trained on after them; no rank keeps the full models.
    def same(t: dict) -> dict:
        return {k: v for k, v in t.items() if k != "seconds"}

    assert all(
        list(map(same, out["transitions"])) == list(map(same, first["transitions"])) for out in per_rank
    )
    assert all(len(out["rewards"]) == 3 for out in per_rank)
    assert all(out["full_model_numel"] == 0 for out in per_rank)


def test_an_infeasible_transition_keeps_the_current_plan(dist4):
    from tests.lightning.helpers import emu_infeasible_keeps_plan

    for out in dist4.run(emu_infeasible_keeps_plan):
        assert out["moved"] is False and out["same"]
        assert out["info"]["mode"] == "kept" and "no safe order" in out["info"]["reason"]
