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
from typing import TYPE_CHECKING, Any

from torch import Tensor

from nereus_lightning.models import MicroBatch, Packed, pack, token_budget_slices, train_step
from nereus_lightning.models.packing import packing_refusal
from nereus_lightning.models.pipeline import position_ids_from_mask
from nereus_lightning.models.sharded import ShardedCausalLM
from nereus_lightning.rl.algorithm import RLConfig, actor_loss, critic_loss
from nereus_lightning.rl.batch import RolloutBatch
from nereus_lightning.rl.forward import response_span
from nereus_lightning.rl.update import Stepped

if TYPE_CHECKING:
    from nereus_lightning.lightning.strategy import NereusStrategy


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
    unit: ShardedCausalLM, part: RolloutBatch, micro_batch: int, remove_padding: bool = True
) -> list[ResponseMicroBatch]:
    """``part`` in micro-batches of at most ``micro_batch`` padded rows' tokens, packed where the unit can.

    ``remove_padding`` False (verl's ``use_remove_padding``): padded micro-batches of ``micro_batch`` rows.
    """
    ids, mask = part.sequences, part.attention_mask
    span = response_span(part.prompt_ids.shape[-1], part.response_ids.shape[-1])
    budget = micro_batch * ids.shape[-1]
    packable = remove_padding and packing_refusal(unit.local_config) is None
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


def replica_backward(
    unit: ShardedCausalLM,
    part: RolloutBatch,
    micro_batch: int,
    cfg: RLConfig,
    normalizer: Tensor,
    tokens: Tensor,
    actor: bool,
    remove_padding: bool = True,
) -> dict[str, Tensor]:
    """Backward of one replica's rows of a mini-batch into its unit's gradients; returns the loss metrics.

    The losses are :func:`~nereus_lightning.rl.algorithm.actor_loss` (``actor``) or ``critic_loss``
    divided by the global mini-batch's ``normalizer`` (its tokens or sequences, by ``cfg.loss_agg_mode``),
    so they sum over micro-batches and replicas to the mini-batch's loss whatever the layout and
    micro-batching. Runs :func:`~nereus_lightning.models.train_step` (1F1B over the pipeline) over
    :func:`response_micro_batches`. The metrics are contributions that sum over replicas.
    """
    metrics: dict[str, Tensor] = {}
    micros = response_micro_batches(unit, part, micro_batch, remove_padding)
    of = {id(m.micro): m for m in micros}

    def loss_of(out: Any, mb: MicroBatch) -> Tensor:
        micro = of[id(mb)]
        if actor:
            log_probs, entropy = (micro.responses(o) for o in out)
            entropy = entropy if cfg.entropy_coeff else entropy.detach()  # reported; no gradient
            loss, m = actor_loss(log_probs, micro.rows, cfg, normalizer, tokens, entropy)
        else:
            loss, m = critic_loss(micro.responses(out), micro.rows, cfg, normalizer, tokens)
        for k, v in m.items():
            metrics[k] = metrics[k] + v if k in metrics else v
        # train_step's objective is the mean over micro-batches; these losses are already shares of
        # the mini-batch's, so each is scaled back up by their number.
        return loss * len(micros)

    train_step(unit, [m.micro for m in micros], loss_of, temperature=cfg.temperature, with_entropy=actor)
    return metrics


@dataclass(frozen=True)
class StageTrainee:
    """A training model-stage as :func:`~nereus_lightning.rl.update.run_updates` trains it on this rank:
    its replica's rows of each mini-batch (balanced by tokens, :meth:`NereusStrategy.slot`) through
    :func:`replica_backward`, then the strategy's optimizer step (gradients summed over the replicas,
    clipped over the shards, the EMU-bound AdamW)."""

    strategy: NereusStrategy
    stage: str
    role: str
    cfg: RLConfig
    remove_padding: bool = True

    def backward(self, mini: RolloutBatch, normalizer: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        """Backward of this replica's rows of ``mini``; the metrics where this rank reports its replica's."""
        slot = self.strategy.slot(self.stage, len(mini), sequence_tokens(mini))
        unit = self.strategy.trainable(self.stage)  # (collective over a ZeRO-3 shard group)
        if not slot.active or slot.stop <= slot.start:
            return {}
        assert unit is not None  # the slot is active: this rank holds a unit
        part = mini.select(slice(slot.start, slot.stop))
        args = (slot.candidate.micro_batch, self.cfg, normalizer, tokens, self.role == "actor")
        metrics = replica_backward(unit, part, *args, remove_padding=self.remove_padding)
        return metrics if unit.comm.is_last_stage and unit.comm.tp_rank == 0 else {}

    def step(self, max_norm: float, samples: int) -> Stepped:
        """The strategy's optimizer step (collective over the model-stage's ranks); its first rank reports
        the norm."""
        done = self.strategy.update(self.stage, max_norm, samples=samples)
        if done.problem is not None:
            return Stepped(done.norm, f"{self.stage}'s gradient norm is {done.norm} ({done.problem})")
        assert self.strategy.plan is not None
        reports = self.strategy.global_rank == self.strategy.plan[self.stage].gpus[0]
        return Stepped(done.norm if reports else None)
