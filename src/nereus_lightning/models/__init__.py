"""How a transformers causal LM is cut into TP shards and PP stages."""

from nereus_lightning.models.sharding import Placement, layer_range, placement, pp_stages, shard_shape, tp_plan_of, tp_slices

__all__ = ["Placement", "layer_range", "placement", "pp_stages", "shard_shape", "tp_plan_of", "tp_slices"]
