"""The planner's memory terms against what the body really holds, measured.

- Activations: the bytes a packed bf16 forward saves for backward (every saved tensor's storage
  once, parameters excluded), per token and layer, against ``plan.memory.activation_bytes_per_token_layer``.
- Logits: the largest logit-shaped tensor any op creates while log-probs and entropy are computed
  (forward and backward) is one chunk of ``plan.memory.logit_chunk_rows`` rows, not the batch's.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nereus_lightning.testing.tiny import VOCAB, my_replica, tiny_model

pytestmark = pytest.mark.distributed

WIDTH = 320  # the vocabulary: a width no other tensor of the model has
SHAPE = dict(
    vocab_size=WIDTH,
    hidden_size=256,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=2,
    attn_implementation="sdpa",
)


class _LargestLogits(TorchDispatchMode):
    """Records the most elements of any op's output shaped like logits (last dimension ``width``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):  # a view of a weight (its transpose) allocates nothing
            return out
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.width:
                self.largest = max(self.largest, t.numel())
        return out


def _measured(rank: int, world: int) -> dict[str, float]:
    import nereus_lightning.models.logprobs as logprobs_module
    from nereus_lightning.models import MicroBatch, ShardedCausalLM, pack, token_scores, train_step
    from nereus_lightning.plan import memory
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.spec import ModelSpec

    model = tiny_model("qwen2", **SHAPE).to(torch.bfloat16)
    spec = ModelSpec.from_hf_config(model.config)
    _, comm = my_replica(rank, world, Layout(1, 1), False)
    unit = ShardedCausalLM.from_model(model, comm)
    ids = torch.randint(0, VOCAB, (16, 16), generator=torch.Generator().manual_seed(rank))
    packed = pack(ids, torch.ones_like(ids))
    params = {p.data_ptr() for p in unit.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        unit.stage(packed.input_ids, None, None, packed.position_ids, None, packed.documents)
    tokens, layers = packed.input_ids.numel(), model.config.num_hidden_layers
    out = {
        "activations": sum(saved.values()) / tokens / layers,
        "activations_model": memory.activation_bytes_per_token_layer(spec),
    }
    kept = logprobs_module.LOGIT_CHUNK_ELEMENTS
    logprobs_module.LOGIT_CHUNK_ELEMENTS = 40 * WIDTH  # 40 rows per chunk; the batch has 256 tokens
    memory_kept = memory.LOGIT_CHUNK_ELEMENTS
    memory.LOGIT_CHUNK_ELEMENTS = logprobs_module.LOGIT_CHUNK_ELEMENTS
    try:
        mb = MicroBatch.packed(packed)
        with _LargestLogits(WIDTH) as scoring:
            token_scores(unit, mb, with_entropy=True)
        with _LargestLogits(WIDTH) as training:
            train_step(unit, [mb], lambda o, m: o[0].sum() + o[1].sum(), with_entropy=True)
        out["largest_scoring"] = scoring.largest
        out["largest_training"] = training.largest
        out["chunk_model"] = memory.logit_chunk_rows(spec, 1) * WIDTH
        out["batch_logits"] = tokens * WIDTH
    finally:
        logprobs_module.LOGIT_CHUNK_ELEMENTS = kept
        memory.LOGIT_CHUNK_ELEMENTS = memory_kept
    return out


def test_memory_terms_match_what_the_body_holds(dist4) -> None:
    for rank, m in enumerate(dist4.run(_measured)):
        ratio = m["activations"] / m["activations_model"]
        assert 0.9 <= ratio <= 1.1, f"rank {rank}: saved activations {ratio:.3f}x the model's ({m})"
        for key in ("largest_scoring", "largest_training"):
            assert m[key] <= m["chunk_model"] < m["batch_logits"], f"rank {rank}: {key} ({m})"
        assert m["largest_scoring"] == m["chunk_model"], "the chunk is the largest tensor scoring makes"
