"""Drift families beyond the paper's steady growth: seeded generators of `DriftTrace`s.

Each family is a shape of drift seen in RL post-training or in a shared GPU pool, with its
timings, sizes and noise drawn from a seed, so a test can draw held-out members of a family
instead of replaying one hand-made trace:

* ``rise_fall``: the mean response length rises to a peak and falls back (a model that first
  rambles, then learns to be brief), while the pool suffers short revocation bursts (several
  nodes taken for a few steps, then returned);
* ``curriculum``: the response-length cap is raised in steps (DeepScaleR's 8K -> 16K -> 24K),
  the length jumps at each raise and then settles, and one node is lost for good mid-run;
* ``pool_growth``: the job runs on part of the pool, then resumes on the full pool (more GPUs
  given to it) and keeps it, while lengths grow slowly;
* ``oscillation``: the length swings slowly around its mean (several cycles per run) on a
  pool that changes rarely.

Pools move by whole nodes (``node`` GPUs); lengths carry seeded log-normal noise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from nereus_lightning.sim.trace import DriftTrace
from nereus_lightning.spec.errors import require


@dataclass(frozen=True)
class FamilyShape:
    """The frame every member of a family is drawn in.

    ``length``: the base mean response length and the largest the family reaches;
    ``gpus``: the smallest and largest pool; ``node``: GPUs per node (pool granularity).
    """

    steps: int = 40
    length: tuple[float, float] = (1000.0, 3000.0)
    gpus: tuple[int, int] = (8, 32)
    node: int = 4
    prompt_len: float = 512.0
    noise: float = 0.03
    p95_ratio: float = 1.15

    def __post_init__(self) -> None:
        require(self.steps >= 12, "family.steps", f"must be >= 12, got {self.steps}")
        require(
            0 < self.length[0] <= self.length[1], "family.length", f"need 0 < base <= peak: {self.length}"
        )
        lo, hi = self.gpus
        require(
            0 < lo <= hi and lo % self.node == 0 and hi % self.node == 0,
            "family.gpus",
            f"{self.gpus} must be positive multiples of node={self.node}, min <= max",
        )


def _nodes(shape: FamilyShape, gpus: float) -> int:
    """``gpus`` rounded down to whole nodes, inside the shape's pool range."""
    lo, hi = shape.gpus
    return max(lo, min(hi, int(gpus // shape.node) * shape.node))


def _trace(
    name: str, shape: FamilyShape, means: list[float], pool: list[int], rng: random.Random
) -> DriftTrace:
    lens = [round(m * math.exp(rng.gauss(0.0, shape.noise)), 1) for m in means]
    p95 = [round(x * shape.p95_ratio, 1) for x in lens]
    return DriftTrace(name, tuple(lens), tuple(p95), (shape.prompt_len,) * shape.steps, tuple(pool))


def rise_fall(shape: FamilyShape, seed: int = 0) -> DriftTrace:
    """Length rises to a peak and falls back; bursts of revocation take nodes for a few steps."""
    rng = random.Random(seed)
    n, (base, peak) = shape.steps, shape.length
    top = rng.uniform(0.35, 0.65) * (n - 1)
    end = base * rng.uniform(1.0, 1.5)
    means = [
        base + (peak - base) * (i / top) ** 1.5
        if i <= top
        else end + (peak - end) * ((n - 1 - i) / (n - 1 - top))
        for i in range(n)
    ]
    pool = [shape.gpus[1]] * n
    for _ in range(rng.randint(2, 4)):  # bursts: a few nodes gone for 1-4 steps
        at, length = rng.randrange(2, n - 1), rng.randint(1, 4)
        lost = rng.randint(1, 3) * shape.node
        for i in range(at, min(n, at + length)):
            pool[i] = _nodes(shape, pool[i] - lost)
    return _trace(f"rise-fall + revocation bursts (seed {seed})", shape, means, pool, rng)


def curriculum(shape: FamilyShape, seed: int = 0) -> DriftTrace:
    """Step-wise curriculum: the length jumps at each raise of the cap; one node lost for good."""
    rng = random.Random(seed)
    n, (base, peak) = shape.steps, shape.length
    raises = sorted(rng.sample(range(4, n - 3), rng.randint(2, 3)))
    factor = (peak / base) ** (1 / len(raises))
    means, level = [], base
    for i in range(n):
        if i in raises:
            level *= factor
        means.append(level * (1 + 0.002 * (i - max([r for r in raises if r <= i], default=0))))
    gone = rng.randrange(n // 4, 3 * n // 4)
    pool = [shape.gpus[1] if i < gone else _nodes(shape, shape.gpus[1] - shape.node) for i in range(n)]
    return _trace(f"curriculum + node loss (seed {seed})", shape, means, pool, rng)


def pool_growth(shape: FamilyShape, seed: int = 0) -> DriftTrace:
    """Part of the pool, then a resume on the full pool that is kept; lengths grow slowly."""
    rng = random.Random(seed)
    n, (base, peak) = shape.steps, shape.length
    grow = rng.randrange(n // 5, n // 2)
    small = _nodes(shape, shape.gpus[1] * rng.choice((0.25, 0.5)))
    top = base + (peak - base) * rng.uniform(0.4, 1.0)
    means = [base + (top - base) * i / (n - 1) for i in range(n)]
    pool = [small if i < grow else shape.gpus[1] for i in range(n)]
    return _trace(f"pool growth after a resume (seed {seed})", shape, means, pool, rng)


def oscillation(shape: FamilyShape, seed: int = 0) -> DriftTrace:
    """The length swings slowly between base and peak; the pool changes once or twice."""
    rng = random.Random(seed)
    n, (base, peak) = shape.steps, shape.length
    period = n / rng.uniform(1.5, 3.0)
    phase = rng.uniform(0, 2 * math.pi)
    mid, amp = (base + peak) / 2, (peak - base) / 2
    means = [mid + amp * math.sin(2 * math.pi * i / period + phase) for i in range(n)]
    pool, level = [], shape.gpus[1]
    changes = set(rng.sample(range(3, n - 2), rng.randint(1, 2)))
    for i in range(n):
        if i in changes:
            level = _nodes(shape, rng.choice((shape.gpus[0], shape.gpus[1], level - shape.node)))
        pool.append(level)
    return _trace(f"slow oscillation (seed {seed})", shape, means, pool, rng)


FAMILIES: dict[str, Callable[[FamilyShape, int], DriftTrace]] = {
    "rise_fall": rise_fall,
    "curriculum": curriculum,
    "pool_growth": pool_growth,
    "oscillation": oscillation,
}


def family_trace(family: str, shape: FamilyShape, seed: int = 0) -> DriftTrace:
    """One member of ``family`` (a key of ``FAMILIES``) drawn with ``seed``."""
    require(family in FAMILIES, "family", f"{family!r} is not one of {list(FAMILIES)}")
    return FAMILIES[family](shape, seed)


@dataclass(frozen=True)
class Combination:
    """One model x cluster x algorithm the families are replayed on, with its family frame."""

    model: str
    cluster: str
    algorithm: str
    shape: FamilyShape

    @property
    def name(self) -> str:
        """A short label for tables."""
        return f"{self.model} {self.algorithm} {self.cluster} {self.shape.gpus[0]}-{self.shape.gpus[1]} GPUs"


#: Eight model x cluster x algorithm combinations (every model family, algorithm and cluster kind
#: the presets have); each frame's lengths are ones the pool can hold at its smallest.
COMBINATIONS: tuple[Combination, ...] = (
    Combination("llama3_8b", "paper_cluster2", "ppo", FamilyShape(length=(1000, 3500), gpus=(8, 32), node=4)),
    Combination(
        "llama3_8b", "paper_cluster3", "grpo", FamilyShape(length=(2000, 8000), gpus=(16, 64), node=8)
    ),
    Combination(
        "qwen3_14b", "paper_cluster2", "grpo", FamilyShape(length=(1000, 3000), gpus=(16, 32), node=4)
    ),
    Combination("qwen2_0_5b", "l40sx8", "ppo", FamilyShape(length=(1000, 4000), gpus=(4, 8), node=2)),
    Combination(
        "qwen3_14b", "paper_cluster3", "ppo", FamilyShape(length=(2000, 6000), gpus=(16, 64), node=8)
    ),
    Combination(
        "llama3_8b", "paper_cluster1", "remax", FamilyShape(length=(1000, 4000), gpus=(32, 128), node=8)
    ),
    Combination("qwen2_0_5b", "h100x8", "grpo", FamilyShape(length=(1000, 8000), gpus=(2, 8), node=2)),
    Combination(
        "qwen3_32b", "paper_cluster3", "grpo", FamilyShape(length=(1000, 4000), gpus=(32, 64), node=8)
    ),
)
