"""The paper-shaped 25-step drift trace: Llama-3.1-8B PPO on paper_cluster2, 8-32 GPUs (real spot trace).

Checks what the controller must deliver there (issue 5): no infeasible step, at least 20% below
the static baseline, below every-k-steps, and within 1% of always-switch's mean step latency while
moving for less transition time (Nereus chooses, among the admissible targets, the one with the
largest net benefit: cheaper transitions for nearly the same step).

Since the cost model prices the optimizer step's fp32 temporaries and decode at the static cache's
length (issue 31), always-switch no longer lands on a plan a revocation leaves without a safe
transition, and Nereus' cheapest urgent move at step 7 (actor training to PP2, whose Split back
never fits beside the co-resident state) costs it ~0.3%: 76.6 vs 76.3 s/step on every seed tried.
"""

from __future__ import annotations

import pytest

from nereus_lightning.sim.experiment import make_setup, run_experiment
from nereus_lightning.sim.trace import paper_trace


@pytest.fixture(scope="module")
def paper_run():
    setup = make_setup("llama3_8b", "paper_cluster2", {"algorithm": "ppo"})
    return run_experiment(setup, paper_trace(), ["static", "always", "every_k:3", "nereus:0.5"], plot=False)


def test_nereus_beats_static_by_20_percent_without_infeasible_steps(paper_run):
    s = paper_run["comparison"].summaries
    nereus, static = s["nereus(gamma=0.5)"], s["static"]
    assert nereus.infeasible_steps == 0 and nereus.restarts == 0
    assert nereus.mean_step_s <= 0.8 * static.mean_step_s
    assert nereus.mean_step_s < s["every-3-steps"].mean_step_s
    assert nereus.mean_step_s < 1.01 * s["always-switch"].mean_step_s
    assert nereus.transition_s < s["always-switch"].transition_s  # nearly the same gains, cheaper moves
    assert nereus.gap_to_oracle < 0.10


def test_trace_is_paper_shaped(paper_run):
    trace = paper_run["comparison"].trace
    assert min(trace.num_gpus) == 8 and max(trace.num_gpus) == 32
    assert trace.response_len[0] == 1147.5 and round(trace.response_len[-1]) == 3722
