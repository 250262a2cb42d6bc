"""How a replica's rollout rows become the micro-batches a unit computes: packed under a token budget.

A micro-batch holds at most ``micro_batch x width`` tokens, where ``micro_batch`` is the plan's
(sequences) and ``width`` the step's padded sequence width: never more than the padded batch the
planner priced, and more sequences at once where they are shorter than the longest. Sequences are
packed end to end without padding (:func:`~nereus_lightning.models.packing.pack`) and the head
scores only the positions before response tokens; a family the packed attention cannot compute
exactly runs padded micro-batches of whole rows instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from nereus_lightning.models import MicroBatch, Packed, pack, token_budget_slices
from nereus_lightning.models.packing import packing_refusal
from nereus_lightning.models.sharded import ShardedCausalLM
from nereus_lightning.rl.batch import RolloutBatch
from nereus_lightning.rl.forward import position_ids_from_mask, response_span


@dataclass(frozen=True)
class ResponseMicroBatch:
    """One micro-batch of rollout rows: what the unit computes (``micro``) and the rows it holds."""

    micro: MicroBatch
    rows: RolloutBatch
    packed: Packed | None
    span: slice

    @property
    def size(self) -> int:
        """Length of the head outputs' first dimension: scored positions when packed, else rows."""
        return len(self.rows) if self.packed is None else int(self.packed.score_positions.numel())

    def responses(self, out: Tensor) -> Tensor:
        """The head outputs of :attr:`micro` per response token, ``[b, R]`` (zero past a response's end)."""
        return out[:, self.span] if self.packed is None else self.packed.unpack(out)[:, self.span]


def sequence_tokens(batch: RolloutBatch) -> list[int]:
    """Each sample's prompt and response tokens (what a packed forward computes)."""
    return batch.attention_mask.sum(-1).tolist()


def response_micro_batches(
    unit: ShardedCausalLM, part: RolloutBatch, micro_batch: int
) -> list[ResponseMicroBatch]:
    """``part`` in micro-batches of at most ``micro_batch`` padded rows' tokens, packed where the unit can."""
    ids, mask = part.sequences, part.attention_mask
    span = response_span(part.prompt_ids.shape[-1], part.response_ids.shape[-1])
    budget = micro_batch * ids.shape[-1]
    packable = packing_refusal(unit.local_config) is None
    lengths = sequence_tokens(part) if packable else [ids.shape[-1]] * len(part)
    out = []
    for rows in token_budget_slices(lengths, budget):
        if not packable:
            m = mask[rows]
            micro = MicroBatch(ids[rows], m, position_ids_from_mask(m))
            out.append(ResponseMicroBatch(micro, part.select(rows), None, span))
            continue
        score = mask[rows].new_zeros(mask[rows].shape)
        score[:, span] = part.response_mask[rows]
        packed = pack(ids[rows], mask[rows], score)
        out.append(ResponseMicroBatch(MicroBatch.packed(packed), part.select(rows), packed, span))
    return out
