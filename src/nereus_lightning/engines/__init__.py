"""Rollout engines: one interface (:class:`RolloutEngine`), sampling seeded per sample, the engine kinds.

``hf``: transformers ``generate`` over a replica's shards (:class:`HFGenerateEngine`), or a cache-free
loop over any logits function (:class:`ForwardEngine`); ``static``: a preallocated KV cache with CUDA-graph
decode steps (:class:`~nereus_lightning.engines.static.StaticDecodeEngine`). The engine the strategy
holds for a generation model-stage is a :class:`~nereus_lightning.engines.base.StageEngine` of a kind
the registry (:mod:`nereus_lightning.engines.registry`) names: ``hf``
(:class:`~nereus_lightning.engines.unit.UnitEngine`, on the unit's own module) or ``vllm`` (vLLM
engines fed from the generation units, :mod:`nereus_lightning.engines.vllm_engine`; vLLM itself is
imported only when used).
"""

from nereus_lightning.engines.base import (
    RolloutEngine,
    RolloutOutput,
    response_rows,
    sample_seeds,
    version_tensor,
)
from nereus_lightning.engines.hf import ForwardEngine, HFGenerateEngine

__all__ = [
    "ForwardEngine",
    "HFGenerateEngine",
    "RolloutEngine",
    "RolloutOutput",
    "response_rows",
    "sample_seeds",
    "version_tensor",
]
