"""The transition planner builds exactly the golden DAGs (``tests/transition/golden.py``).

Every benchmark scenario, a few hundred seeded random cases and hand-picked layout changes give
the DAGs (and the infeasibility messages) recorded in ``golden_dags.json``, node for node; every
DAG built passes the validator's replay. A change of the planner that changes a DAG on purpose
regenerates the file (``PYTHONPATH=src python -m tests.transition.golden``) and says why here.

Regenerated 2026-12-04 (93 of 467 DAGs changed, the rest and every baseline and infeasibility
message identical): a model-stage that a same-stage peer can make wait was one node per replica;
now the lanes of a step that no peer can make wait share one node (as a model-stage's do when
none can), and after the ordered replay alike calls of one model-stage that wait for exactly the
same nodes are joined into one (a subset of the executions the separate nodes allowed); then
(15 more changed) only nodes of one step are joined, their lanes in the step's order. Every
changed DAG passes the validator (``compute`` asserts it); the local DAGs' lanes are unchanged.

Regenerated again (2 of 467 changed, both infeasibility messages; every DAG identical): the
waiting lanes of a step that wait for the same peer releases after the same nodes now share one
node before the replay (they ran alike and were joined after it anyway), so a stuck message names
such calls together (``extend of actor_infer onto [6, 7], [8, 9]: ...``), counting every call.

Regenerated 2026-12-05 (issue 31, the cost model): only the 12 timed benchmark scenarios, whose
plans the planner makes, changed input (the memory model as the body holds it, decode priced at the
static cache's length, the leanest of equally fast candidates); their DAGs follow from the new plans
(7 of the 12 are now infeasible, 6 were). The other 455 cases, DAGs and baselines, are identical.

Regenerated again (issue 31, the memory cap): a GPU's cap is now the allocator's share, the GPU's
memory less the 10% headroom and ``ClusterSpec.reserved_memory`` (1 GiB on the GPU presets: CUDA
context, NCCL, cuBLAS, which the peaks no longer include). Every case's input (its cluster) gained the
field; the random and hand-made cases' synthetic clusters have no reserved memory (their memory is
sized from the plans' peaks), so their DAGs are identical. The 7 timed benchmark DAGs that changed
run on the presets' 1 GiB less: infeasibility messages that quote the cap, as many feasible as before.

Regenerated 2026-12-06 (12 of 467 changed, all of them cases whose input plans changed: the timed
grow and drift scenarios, whose planner now prices ZeRO's shard-group collectives once per step;
the other 455 DAGs, baselines and messages identical, with the shard-degree re-cut in the build).

Regenerated 2026-12-06 again (399 of 467 changed): the cases' critic and reward model are now the
value models the body builds (``transition.scenarios.default_models`` maps the roles through
``plan.job_models``: a one-output ``score`` head in place of Llama-3.1-8B's LM head, 525M fewer
parameters). 310 cases' inputs changed (the random cases' clusters are sized from the plans'
resident peaks, the timed scenarios' plans are the planner's), 89 more changed their DAG or baseline
alone (the critic's and reward model's transfers and memory effects); the 68 others, where no critic
or reward state moves or sizes the cluster (the hand cases move the actor alone), are identical.
298 DAGs are feasible (295 before; of the 30 timed scenarios 23, 20 before).

Regenerated 2026-12-06 a third time (2 of 467 changed, both timed scenarios at 1,024 GPUs whose
plans the planner makes): a decode step is priced at the fused kernels of a replayed graph
(``cost.DECODE_KERNELS_PER_LAYER``, 8 a layer, was 16), so the grow and drift plans at that size
changed; the DAG that was feasible still is, the infeasible one still is. The other 465 are identical.
"""

from __future__ import annotations

import json

from tests.transition import golden


def test_every_golden_case_builds_the_recorded_dag() -> None:
    recorded = json.loads(golden.GOLDEN.read_text())
    got = golden.compute()
    assert got.keys() == recorded.keys(), "the golden cases changed: regenerate golden_dags.json"
    changed_input = [case for case in got if got[case]["input"] != recorded[case]["input"]]
    assert not changed_input, f"these cases' plans changed (the planner?), regenerate: {changed_input[:5]}"
    for part in ("dag", "baseline"):
        differ = [case for case in got if got[case][part] != recorded[case][part]]
        assert not differ, f"{len(differ)} {part} DAGs differ from the golden ones, e.g. {differ[:5]}"


def test_the_golden_cases_cover_every_benchmark_scenario_and_both_outcomes() -> None:
    recorded = json.loads(golden.GOLDEN.read_text())
    timed = [case for case in recorded if case.startswith("bench timed")]
    assert len(timed) == 6 * len(golden._bench()._scenarios(32))
    assert sum(case.startswith("random") for case in recorded) >= 280
    infeasible = sum(d["dag"].startswith("infeasible") for d in recorded.values())
    assert 0 < infeasible < len(recorded) / 2
