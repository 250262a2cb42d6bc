"""How a transformers causal LM is cut into TP shards and PP stages, and how the shards compute.

Only the families of the registry (``spec.families``) are built; every entry point refuses the
rest. Value models (critic, reward model: token classification with one label) are cut the same way,
their ``score`` head replicated over TP on the last stage (:mod:`nereus_lightning.proof` checks a family
against the unsharded transformers model). :func:`fail_together` makes an exception on one rank stop
every rank promptly (the pipeline functions run under it). transformers ``generate`` over a sharded
replica: :class:`nereus_lightning.models.generation.ShardedGenerator` (that module imports
transformers; this package does not). The rollout engines over these shards live in
:mod:`nereus_lightning.engines`.
"""

from nereus_lightning.models.fail_fast import PeerFailure, fail_together
from nereus_lightning.models.groups import ReplicaComm, group_for, replica_groups
from nereus_lightning.models.optim import bind_adamw, clip_grad_norm_, grad_norm
from nereus_lightning.models.packing import Documents, Packed, pack, token_budget_slices
from nereus_lightning.models.pipeline import (
    MicroBatch,
    forward_logits,
    pipeline_forward,
    split_micro_batches,
    token_logprobs,
    token_scores,
    train_step,
)
from nereus_lightning.models.sharded import ShardedCausalLM, local_config, shard_state, validate_layout
from nereus_lightning.models.sharding import (
    Fused,
    Placement,
    layer_range,
    placement,
    pp_stages,
    shard_shape,
    tp_plan_of,
    tp_slices,
)

__all__ = [
    "Documents",
    "Fused",
    "MicroBatch",
    "Packed",
    "PeerFailure",
    "Placement",
    "ReplicaComm",
    "ShardedCausalLM",
    "bind_adamw",
    "clip_grad_norm_",
    "fail_together",
    "forward_logits",
    "grad_norm",
    "group_for",
    "layer_range",
    "local_config",
    "pack",
    "pipeline_forward",
    "placement",
    "pp_stages",
    "replica_groups",
    "shard_shape",
    "shard_state",
    "split_micro_batches",
    "token_budget_slices",
    "token_logprobs",
    "token_scores",
    "tp_plan_of",
    "tp_slices",
    "train_step",
    "validate_layout",
]
