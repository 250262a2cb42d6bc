"""Drift traces: anchor points, GPU ranges, shipped spot traces."""

from __future__ import annotations

import pytest

from nereus_lightning.control import load_spot_trace
from nereus_lightning.sim.trace import (
    SPOT_TRACES,
    DriftTrace,
    build_trace,
    length_curve,
    long_trace,
    paper_trace,
    spot_trace_path,
)
from nereus_lightning.spec.errors import NereusConfigError


def test_shipped_spot_traces_are_package_data():
    for name in SPOT_TRACES:
        counts, gap = load_spot_trace(spot_trace_path(name))
        assert gap == 300 and len(counts) > 3000 and max(counts) == 16 and min(counts) == 0


def test_length_curves_hit_the_anchors():
    lin = length_curve(25, 1147.5, 3722.0)
    geo = length_curve(25, 1147.5, 3722.0, "geometric")
    assert (
        lin[0] == geo[0] == 1147.5 and lin[-1] == pytest.approx(3722.0) and geo[-1] == pytest.approx(3722.0)
    )
    assert lin[12] > geo[12]  # the geometric curve grows late
    with pytest.raises(NereusConfigError, match="trace.shape"):
        length_curve(3, 1, 2, "cubic")


def test_paper_trace_shape():
    t = paper_trace()
    assert len(t) == 25
    assert (t.response_len[0], t.response_len_p95[0]) == (1147.5, 1339.0)
    assert t.response_len[-1] == pytest.approx(3722.0) and t.response_len_p95[-1] == pytest.approx(4072.0)
    assert min(t.num_gpus) == 8 and max(t.num_gpus) == 32 and all(g % 4 == 0 for g in t.num_gpus)
    assert len(set(t.num_gpus)) > 3  # follows the spot trace, not a constant


@pytest.mark.parametrize("supply", SPOT_TRACES)
def test_long_traces(supply, tmp_path):
    t = long_trace(supply)
    assert len(t) == 1000 and t.response_len[0] == 500 and t.response_len[-1] == pytest.approx(8000)
    assert 64 <= min(t.num_gpus) and max(t.num_gpus) <= 1024 and all(g % 8 == 0 for g in t.num_gpus)
    t.save(tmp_path / "t.json")
    assert DriftTrace.load(tmp_path / "t.json") == t


def test_noise_is_seeded():
    a = build_trace(10, (1000, 2000), noise=0.05, seed=1)
    b = build_trace(10, (1000, 2000), noise=0.05, seed=1)
    c = build_trace(10, (1000, 2000), noise=0.05, seed=2)
    assert a == b and a != c
    assert all(p >= m for m, p in zip(a.response_len, a.response_len_p95, strict=False))
