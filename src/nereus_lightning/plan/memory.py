"""Per-GPU memory of a model-stage replica (a first cut; the cost-model work extends this file)."""

from __future__ import annotations

from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.model import ModelSpec

# Mixed-precision AdamW, ZeRO-0: fp32 master weights + exp_avg + exp_avg_sq per parameter.
OPTIMIZER_BYTES_PER_PARAM = 12


def stage_params(model: ModelSpec, pp: int, pp_rank: int) -> int:
    """Parameters held by pipeline stage ``pp_rank`` (embedding first, final norm and LM head last)."""
    base, extra = divmod(model.num_layers, pp)
    layers = base + (1 if pp_rank < extra else 0)
    params = layers * model.layer_params
    if pp_rank == 0:
        params += model.embedding_params
    if pp_rank == pp - 1:
        params += model.hidden + (model.lm_head_params if not model.tie_embeddings or pp == 1 else model.embedding_params)
    return params


def state_bytes_per_gpu(model: ModelSpec, trains: bool, layout: Layout) -> float:
    """Resident state bytes on the most-loaded GPU of one replica.

    Inference holds weights; training adds gradients (weight dtype) and AdamW state.
    TP splits every stage's parameters evenly (replicated norms are negligible).
    """
    per_param = model.dtype_bytes * (2 if trains else 1) + (OPTIMIZER_BYTES_PER_PARAM if trains else 0)
    worst = max(stage_params(model, layout.pp, r) for r in range(layout.pp))
    return worst / layout.tp * per_param
