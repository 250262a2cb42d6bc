"""The step signals the callback builds from a step's metrics (one process, no collective)."""

from __future__ import annotations

from nereus_lightning.control import Controller, ControllerConfig, PlannerBackend
from nereus_lightning.lightning.callback import _signals
from nereus_lightning.spec import Workload, cluster_preset, model_preset

GIB = 2**30
WORKLOAD = Workload("grpo", 8, samples_per_prompt=4, prompt_len=6, response_len=64.0)


def test_per_stage_peaks_reach_the_signals_beside_the_step_peak():
    stats = {
        "response_length/mean": 100.0,
        "prompt_length/mean": 20.0,
        "perf/max_memory_allocated_gb": 12.0,
        "perf/max_memory_allocated_gb/gen": 8.0,
        "perf/max_memory_allocated_gb/infer": 6.0,
        "perf/max_memory_allocated_gb/train": 12.0,
        "timing_s/gen": 1.5,
    }
    signals = _signals(3, stats, (0,), expected=WORKLOAD)
    assert signals.peak_memory == {0: 12.0 * GIB}  # the step's peak per rank, as before
    assert signals.stage_peak_memory == {
        "generation": {0: 8.0 * GIB},
        "inference": {0: 6.0 * GIB},
        "training": {0: 12.0 * GIB},
    }
    assert signals.stage_time == {"gen": 1.5}


def test_no_gpu_no_peaks():
    signals = _signals(1, {"response_length/mean": 10.0}, (0, 1), expected=WORKLOAD)
    assert signals.peak_memory == {} and signals.stage_peak_memory == {}


def test_a_module_that_reports_no_lengths_leaves_the_controllers_view_unchanged():
    """A ``training_step`` that returns nothing: the controller sees the lengths the module's workload
    expects, as at the initial plan, and has nothing to move for."""
    pool = (0, 1, 2, 3)
    initial = _signals(0, {}, pool, expected=WORKLOAD)
    silent = _signals(1, {}, pool, expected=WORKLOAD)
    assert (silent.response_len, silent.response_len_p95, silent.prompt_len) == (64.0, 64.0, 6.0)
    assert (initial.response_len, initial.prompt_len) == (silent.response_len, silent.prompt_len)
    backend = PlannerBackend.for_models(model_preset("tiny_llama"))
    controller = Controller(backend, cluster_preset("cpu4"), WORKLOAD, ControllerConfig())
    assert controller.step(initial).kind == "initial"
    assert all(controller.step(_signals(s, {}, pool, expected=WORKLOAD)).kind == "none" for s in (1, 2, 3))
