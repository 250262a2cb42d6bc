"""Drift traces: a response-length series plus a GPU-supply series, one entry per RL step.

Lengths follow growth curves through published anchor points (no raw curves are public):
Nereus' 25-step held-out trace (mean 1,147.5 -> 3,722 tokens, p95 1,339 -> 4,072) and its
1,000-step run (mean 500 -> 8,000 tokens). GPU supply comes from the real spot traces shipped in
``sim/traces/`` (see its README), scaled onto a GPU range.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any

from nereus_lightning.control.resources import TraceResources, load_spot_trace
from nereus_lightning.control.signals import StepSignals
from nereus_lightning.spec.errors import NereusConfigError, require

SPOT_TRACES = ("us-east-2b_v100_1", "us-west-2a_v100_1", "us-west-2c_v100_1")
CURVE_SHAPES = ("linear", "geometric")


def spot_trace_path(name: str) -> str:
    """Path of a shipped spot trace (``SPOT_TRACES``) or of any trace JSON file given by path."""
    if name in SPOT_TRACES:
        return str(resources.files("nereus_lightning.sim") / "traces" / f"{name}.json")
    if os.path.isfile(name):
        return name
    raise NereusConfigError(
        f"trace.supply: {name!r} is neither a shipped trace ({', '.join(SPOT_TRACES)}) nor a file"
    )


def length_curve(steps: int, start: float, end: float, shape: str = "linear") -> list[float]:
    """A growth curve through ``start`` (step 0) and ``end`` (last step).

    ``linear`` grows by the same number of tokens per step (DeepSeek-R1-Zero reports roughly
    linear growth); ``geometric`` by the same factor per step.
    """
    require(steps >= 1, "trace.steps", f"must be >= 1, got {steps}")
    require(start > 0 and end > 0, "trace.length", f"lengths must be positive, got {start} -> {end}")
    require(shape in CURVE_SHAPES, "trace.shape", f"{shape!r} is not one of {CURVE_SHAPES}")
    if steps == 1:
        return [float(start)]
    t = [i / (steps - 1) for i in range(steps)]
    if shape == "linear":
        return [start + (end - start) * x for x in t]
    return [start * (end / start) ** x for x in t]


@dataclass(frozen=True)
class DriftTrace:
    """Per-step response length (mean, p95), prompt length and GPU supply."""

    name: str
    response_len: tuple[float, ...]
    response_len_p95: tuple[float, ...]
    prompt_len: tuple[float, ...]
    num_gpus: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.response_len)
        require(n >= 1, "trace", "has no steps")
        for field in ("response_len_p95", "prompt_len", "num_gpus"):
            require(
                len(getattr(self, field)) == n,
                f"trace.{field}",
                f"has {len(getattr(self, field))} steps, expected {n}",
            )

    def __len__(self) -> int:
        return len(self.response_len)

    def signals(self, step: int, **measured) -> StepSignals:
        """The monitor signals of ``step`` (measured timings/memory passed through)."""
        return StepSignals(
            step,
            self.response_len[step],
            self.response_len_p95[step],
            self.prompt_len[step],
            tuple(range(self.num_gpus[step])),
            **measured,
        )

    def to_json(self) -> dict:
        """A JSON-serialisable form."""
        return {
            "name": self.name,
            "response_len": list(self.response_len),
            "response_len_p95": list(self.response_len_p95),
            "prompt_len": list(self.prompt_len),
            "num_gpus": list(self.num_gpus),
        }

    @classmethod
    def from_json(cls, raw: dict) -> DriftTrace:
        """Inverse of :meth:`to_json`."""
        return cls(
            raw["name"],
            tuple(raw["response_len"]),
            tuple(raw["response_len_p95"]),
            tuple(raw["prompt_len"]),
            tuple(int(g) for g in raw["num_gpus"]),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> DriftTrace:
        """Read a trace written by :meth:`save`."""
        with open(path) as f:
            return cls.from_json(json.load(f))

    def save(self, path: str | os.PathLike) -> None:
        """Write this trace as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f)


def build_trace(
    steps: int,
    mean: tuple[float, float],
    p95: tuple[float, float] | None = None,
    prompt_len: float = 512,
    supply: str = "us-east-2b_v100_1",
    min_gpus: int = 8,
    max_gpus: int = 32,
    granularity: int = 4,
    ticks_per_step: float = 1.0,
    start_tick: int = 0,
    shape: str = "linear",
    noise: float = 0.0,
    seed: int = 0,
    name: str = "",
) -> DriftTrace:
    """Combine a length growth curve with a scaled spot-availability trace.

    ``p95`` gives the p95 at the first and last step (default 1.15 x mean); the p95/mean ratio is
    interpolated linearly in between. ``noise`` is the relative standard deviation of seeded
    per-step noise on the length (the p95 keeps its ratio to the mean).
    """
    require(noise >= 0, "trace.noise", f"must be >= 0, got {noise}")
    means = length_curve(steps, mean[0], mean[1], shape)
    p0, p1 = p95 if p95 is not None else (1.15 * mean[0], 1.15 * mean[1])
    require(p0 >= mean[0] and p1 >= mean[1], "trace.p95", f"p95 {p95} must not be below the mean {mean}")
    r0, r1 = p0 / mean[0], p1 / mean[1]
    rng = random.Random(seed)
    lens, p95s = [], []
    for i, m in enumerate(means):
        x = i / max(steps - 1, 1)
        jitter = math.exp(rng.gauss(0.0, noise)) if noise and 0 < i < steps - 1 else 1.0
        lens.append(round(m * jitter, 1))
        p95s.append(round(m * jitter * (r0 + (r1 - r0) * x), 1))
    counts, _ = load_spot_trace(spot_trace_path(supply))
    res = TraceResources(counts, min_gpus, max_gpus, ticks_per_step, start_tick, granularity, max_count=16)
    gpus = tuple(res.num_gpus(s) for s in range(steps))
    label = (
        name or f"{os.path.basename(supply).removesuffix('.json')} {min_gpus}-{max_gpus} GPUs, {steps} steps"
    )
    return DriftTrace(label, tuple(lens), tuple(p95s), tuple(float(prompt_len) for _ in range(steps)), gpus)


def paper_trace(supply: str = "us-east-2b_v100_1", start_tick: int = 0, **kwargs) -> DriftTrace:
    """The paper's 25-step held-out shape: mean 1,147.5 -> 3,722 tokens, p95 1,339 -> 4,072, 8-32 GPUs."""
    args: dict[str, Any] = dict(
        steps=25,
        mean=(1147.5, 3722.0),
        p95=(1339.0, 4072.0),
        min_gpus=8,
        max_gpus=32,
        granularity=4,
        ticks_per_step=3.0,
        start_tick=start_tick,
        supply=supply,
        name="paper 25-step drift",
    )
    args.update(kwargs)
    return build_trace(**args)


def long_trace(supply: str = "us-east-2b_v100_1", steps: int = 1000, **kwargs) -> DriftTrace:
    """The paper's long run: mean 500 -> 8,000 tokens over 1,000 steps, supply scaled to 64 ... 1,024 GPUs."""
    args: dict[str, Any] = dict(
        steps=steps,
        mean=(500.0, 8000.0),
        min_gpus=64,
        max_gpus=1024,
        granularity=8,
        ticks_per_step=0.2,
        supply=supply,
        name=f"{supply} 64-1024 GPUs, {steps} steps",
    )
    args.update(kwargs)
    return build_trace(**args)
