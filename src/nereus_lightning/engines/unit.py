"""The built-in rollout engine (``hf``): a generation model-stage decodes on its unit's own module.

Each call picks its decode loop by the decode mode
(:data:`~nereus_lightning.engines.static.DECODE_MODES`) on the unit as it is then (``"auto"``: the
compiled static decoder on a GPU, transformers ``generate`` elsewhere). Its weights are the
unit's tensors, so a weight sync needs no load; sleeping frees the unit's static decoder, whose KV
cache and graphs hold device memory and the unit's device addresses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from nereus_lightning.engines.base import Decoding, GenerationSite, RolloutOutput, StageEngine, UnitShards
from nereus_lightning.engines.hf import HFGenerateEngine
from nereus_lightning.engines.static import StaticDecodeEngine, decode_path, release_decoder
from nereus_lightning.models.generation import ShardedGenerator
from nereus_lightning.models.sharded import ShardedCausalLM
from nereus_lightning.spec.workload import GenerationEngine


class UnitEngine:
    """A :class:`~nereus_lightning.engines.base.StageEngine` on this rank's unit of a generation replica.

    Every rank of the replica calls :meth:`generate` with the same prompts and gets the same responses.

    Args:
        unit: this rank's compute module of the generation model-stage.
        decoding: eos, pad and the decode mode.
    """

    on_unit = True

    def __init__(self, unit: ShardedCausalLM, decoding: Decoding) -> None:
        self.unit = unit
        self.decoding = decoding

    @property
    def policy_version(self) -> int | None:
        """None: the responses carry no version (the weights are the unit's, whatever its version)."""
        return None

    def generate(
        self,
        prompt_ids: Tensor,
        attention_mask: Tensor,
        max_new_tokens: int,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        sample_seeds: Sequence[int] | Tensor | None = None,
    ) -> RolloutOutput:
        """See :class:`~nereus_lightning.engines.base.RolloutEngine`; sampling needs ``sample_seeds``."""
        eos, pad = self.decoding.eos_token_id, self.decoding.pad_token_id
        path = decode_path(self.decoding.decode, self.unit)
        engine: StaticDecodeEngine | HFGenerateEngine
        if path == "eager":
            engine = HFGenerateEngine(ShardedGenerator(self.unit), eos, pad)
        else:  # the unit's decoder is cached per unit
            engine = StaticDecodeEngine(self.unit, eos, pad, compiled=path == "compiled")
        return engine.generate(
            prompt_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, sample_seeds
        )

    def load(self, shards: UnitShards) -> None:
        """Nothing to take: the engine decodes on the unit's own tensors."""

    def sleep(self) -> None:
        """Free the unit's static decoder (rebuilt by the next generation)."""
        release_decoder(self.unit)

    def wake(self) -> None:
        """Nothing to bring back: the next generation builds what it needs."""

    def close(self) -> None:
        """Free the unit's static decoder."""
        release_decoder(self.unit)


class UnitEngines:
    """The built-in kind: one :class:`UnitEngine` per generation model-stage, on its unit's ranks."""

    on_unit = True

    def require_installed(self, key: str) -> None:
        """Always installed (transformers)."""

    def check_model(self, config: Any, key: str) -> None:
        """Every causal LM the units build decodes here."""

    def check_sites(self, sites: Sequence[GenerationSite]) -> None:
        """Every layout the units take decodes here."""

    def place(
        self,
        sites: Sequence[GenerationSite],
        previous: Sequence[GenerationSite],
        held: Mapping[str, StageEngine],
        decoding: Decoding,
        settings: GenerationEngine,
    ) -> dict[str, StageEngine]:
        """An engine on each unit of this rank (a plan's units are new modules: none is kept)."""
        for engine in held.values():
            engine.close()
        return {s.model_stage: UnitEngine(s.unit, decoding) for s in sites if s.unit is not None}


__all__ = ["UnitEngine", "UnitEngines"]
