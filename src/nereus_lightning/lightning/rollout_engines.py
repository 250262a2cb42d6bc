"""`RolloutEngines`: this rank's rollout engine of each generation model-stage, held across steps.

The engine kind (:mod:`nereus_lightning.engines.registry`) places the engines for each plan
(keeping those that still serve their layout). An engine that decodes on weights of its own takes
its generation unit's shards, on this rank, before the first generation after a weight sync or a
rebuild made them newer (the unit's policy version differs from the engine's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from nereus_lightning import emu
from nereus_lightning.engines.base import Decoding, EngineKind, GenerationSite, StageEngine, UnitShards
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.workload import GenerationEngine


def unit_shards(unit: emu.EMU) -> UnitShards:
    """This rank's shards of a generation unit as an engine takes them (PP 1: the position is the TP rank)."""
    schema = unit.schema
    tp_rank = unit.unit.gpus.index(unit.rank)
    return UnitShards(unit.params, schema.shape_of, schema.placements, tp_rank, unit.counters.policy_version)


class RolloutEngines:
    """The engines of the generation model-stages on this rank.

    Args:
        kind: the engine kind (``algorithm.rollout_engine``).
        settings: its settings (the workload's generation engine).
        decoding: how responses end and are padded; None: no generation through the strategy
            (no engine is placed).
    """

    def __init__(self, kind: EngineKind, settings: GenerationEngine, decoding: Decoding | None) -> None:
        self.kind = kind
        self.settings = settings
        self.decoding = decoding
        self.sites: list[GenerationSite] = []  # those the engines were placed for
        self.engines: dict[str, StageEngine] = {}

    def check(self, sites: Sequence[GenerationSite]) -> None:
        """Refuse a plan's generation layout the engine kind cannot take (before anything moves)."""
        if sites:
            self.kind.check_sites(sites)

    def place(self, sites: Sequence[GenerationSite]) -> None:
        """The engines for a new plan's generation model-stages (collective)."""
        if self.decoding is None or not sites:
            return
        self.engines = self.kind.place(sites, self.sites, self.engines, self.decoding, self.settings)
        self.sites = list(sites)

    def get(self, model_stage: str) -> StageEngine | None:
        """This rank's engine of ``model_stage`` as it is (None: none here)."""
        return self.engines.get(model_stage)

    def engine(self, model_stage: str) -> StageEngine:
        """This rank's engine of generation model-stage ``model_stage``, with its unit's current weights."""
        unit, engine = emu.registry().mine(model_stage), self.engines.get(model_stage)
        if engine is None or unit is None:
            raise NereusConfigError(
                f"algorithm.rollout_engine: {model_stage}: no rollout engine with a unit on rank "
                f"{dist.get_rank() if dist.is_initialized() else 0}"
            )
        if not engine.on_unit and engine.policy_version != unit.counters.policy_version:
            engine.load(unit_shards(unit))
        return engine


__all__ = ["RolloutEngines", "unit_shards"]
