"""Admission by proof: a family outside the registry runs the exactness self-check once, then is cached.

:func:`check_family` runs a tiny random model of the config's class on gloo ranks of this machine at
TP1/2 x PP1/2 (logits and token log-probs within 1e-5 of the unsharded transformers model, one
training step's gradients within 1e-5 relative) and, on 4 ranks, the unit state through
Split/Merge (bit for bit). :func:`admit` does so only for an unregistered model type with no
verdict for the installed transformers, and records the verdict (``spec.verdicts``), which
``spec.families.family_of`` then reads: exact everywhere admits, anything else refuses with the
layout and the difference.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from nereus_lightning.proof.selfcheck import chain_errors, layout_outcomes, worst
from nereus_lightning.spec.families import FAMILIES
from nereus_lightning.spec.verdicts import (
    LayoutVerdict,
    Verdict,
    cached_verdict,
    on_trial,
    save_verdict,
    transformers_version,
)
from nereus_lightning.testing.shrink import tiny_config_of

#: The layouts a proof covers, and the tolerances of its checks.
REQUIRED = ((1, 1), (2, 1), (1, 2), (2, 2))
TOLERANCE = {"logits": 1e-5, "values": 1e-5, "logprobs": 1e-5, "grads": 1e-5, "state_diffs": 0.0}
#: The step of the self-check that moves the unit state through Split/Merge.
SPLIT_MERGE = "split_merge"


def _judge(per_rank: list[dict[str, dict[str, float] | str]]) -> dict[str, LayoutVerdict]:
    """One verdict per layout from every rank's outcomes: an error on any rank, or the worst error."""
    out: dict[str, LayoutVerdict] = {}
    for name in per_rank[0]:
        failed = next((r[name] for r in per_rank if isinstance(r[name], str)), None)
        if isinstance(failed, str):
            out[name] = LayoutVerdict(False, float("inf"), failed)
            continue
        errors = worst([r[name] for r in per_rank])  # type: ignore[misc]  # no str left
        out[name] = _within(errors)
    return out


def _within(errors: Mapping[str, float]) -> LayoutVerdict:
    """Exact when every check is within its tolerance; else the first difference, named."""
    for key, err in errors.items():
        tol = TOLERANCE[key.rpartition("/")[2]]
        if not err <= tol:
            return LayoutVerdict(False, err, f"{key} differ by {err:.2e} (tolerance {tol:g})")
    return LayoutVerdict(True, max(errors.values(), default=0.0))


def check_family(config: Any, pool: Any = None, world_size: int = 4) -> Verdict:
    """The self-check's verdict on ``config``'s family (registered or not), on ``pool`` or a new one."""
    from nereus_lightning.testing import WorkerError, WorkerPool

    start = time.perf_counter()
    with on_trial(config.model_type):
        tiny = tiny_config_of(config)
    own = pool is None
    if own:
        # A rank that breaks alone must not leave the others waiting long in a collective.
        os.environ.setdefault("NEREUS_PG_TIMEOUT", "30")
        pool = WorkerPool(world_size)
    layouts: dict[str, LayoutVerdict] = {}
    try:
        try:
            layouts.update(_judge(pool.run(layout_outcomes, tiny, REQUIRED)))
        except WorkerError as exc:
            reason = str(exc).strip().splitlines()[-1][:300]
            layouts.update({f"tp{t}pp{p}": LayoutVerdict(False, float("inf"), reason) for t, p in REQUIRED})
        if pool.world_size == 4 and all(v.exact for v in layouts.values()):
            try:
                chain = worst(pool.run(chain_errors, tiny))
                layouts[SPLIT_MERGE] = _within(chain)
            except WorkerError as exc:
                reason = str(exc).strip().splitlines()[-1][:300]
                layouts[SPLIT_MERGE] = LayoutVerdict(False, float("inf"), reason)
    finally:
        if own:
            pool.close()
    return Verdict(str(config.model_type), transformers_version(), layouts, time.perf_counter() - start)


def admit(config: Any, pool: Any = None, world_size: int = 4) -> Verdict | None:
    """Admit ``config``'s family by proof when it needs it: None for a registered family, else its verdict.

    A cached verdict for this model type and transformers version is returned as is; otherwise
    the self-check runs (well under a minute for a tiny model) and its verdict is cached.
    """
    model_type = str(config.model_type)
    if model_type in FAMILIES:
        return None
    cached = cached_verdict(model_type)
    if cached is not None and (cached.failure is not None or len(cached.layouts) > len(REQUIRED)):
        return cached
    verdict = check_family(config, pool, world_size)
    save_verdict(verdict)
    return verdict
