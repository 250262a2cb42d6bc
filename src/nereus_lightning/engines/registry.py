"""The rollout engines by name (``algorithm.rollout_engine``): the one list of them in the body.

A new engine is a :class:`~nereus_lightning.engines.base.StageEngine` and its
:class:`~nereus_lightning.engines.base.EngineKind` in a module of ``engines/``, one line here, and
its name in :data:`nereus_lightning.spec.workload.ENGINES` (how the planner prices its memory; the
brain imports no body module, so it keeps its own line, and a test pins the two equal).
"""

from __future__ import annotations

from nereus_lightning.engines.base import EngineKind
from nereus_lightning.engines.unit import UnitEngines
from nereus_lightning.engines.vllm_engine import VLLMEngines
from nereus_lightning.spec.errors import require

ENGINES: dict[str, EngineKind] = {
    "hf": UnitEngines(),
    "vllm": VLLMEngines(),
}


def engine_kind(name: str, key: str = "algorithm.rollout_engine") -> EngineKind:
    """The registered engine kind ``name``; refused naming ``key`` and the known ones."""
    require(name in ENGINES, key, f"{name!r} is not one of {list(ENGINES)}")
    return ENGINES[name]


__all__ = ["ENGINES", "engine_kind"]
