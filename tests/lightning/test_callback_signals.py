"""The step signals the callback builds from a step's metrics (one process, no collective)."""

from __future__ import annotations

from nereus_lightning.lightning.callback import _signals

GIB = 2**30


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
    signals = _signals(3, stats, (0,))
    assert signals.peak_memory == {0: 12.0 * GIB}  # the step's peak per rank, as before
    assert signals.stage_peak_memory == {
        "generation": {0: 8.0 * GIB},
        "inference": {0: 6.0 * GIB},
        "training": {0: 12.0 * GIB},
    }
    assert signals.stage_time == {"gen": 1.5}


def test_no_gpu_no_peaks():
    signals = _signals(1, {"response_length/mean": 10.0}, (0, 1))
    assert signals.peak_memory == {} and signals.stage_peak_memory == {}
