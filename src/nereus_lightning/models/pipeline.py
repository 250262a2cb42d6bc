"""Micro-batched pipeline schedules over a :class:`ShardedCausalLM`: scoring and one training step.

Activations flow between the stage ranks at the same TP rank (point-to-point, global ranks).
Scoring runs every micro-batch forward through the stages (data moves one way, so blocking
send / recv cannot deadlock). Training runs 1F1B: stage ``s`` of ``pp`` does ``pp - s - 1``
warm-up forwards, then alternates one forward and one backward, then drains the backwards, so
at most ``pp - s`` micro-batches hold activations (the planner's memory model). Where a stage
sends one way and receives the other in the same step, both are posted together
(``batch_isend_irecv``), as Megatron-LM does, so neither side waits on the other. Backward is
explicit: ``torch.autograd.backward(output, received_grad)``. Every rank of a replica must call
these functions with the same micro-batches (token ids are needed everywhere for shapes and
masks; only the first stage embeds them). An exception on one rank inside these functions stops
every rank promptly with that rank's error (:func:`~nereus_lightning.models.fail_fast.fail_together`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from nereus_lightning.models.fail_fast import fail_together
from nereus_lightning.models.logprobs import head_logprobs
from nereus_lightning.models.optim import clip_grad_norm_
from nereus_lightning.models.packing import Documents, Packed
from nereus_lightning.models.sharded import ShardedCausalLM, all_reduce_flat
from nereus_lightning.spec.errors import require

Where = Literal["all", "first", "last"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: token ids ``[B, S]``, optional padding mask / positions, and loss inputs.

    A packed micro-batch (:meth:`packed`) is one row of sequences laid end to end (``documents``);
    ``score_positions`` (flat positions into ``[B * S]``) restricts the head to the positions whose
    outputs the loss reads: the head then returns ``[n]`` values in that order (see :func:`head_outputs`).
    """

    input_ids: Tensor
    attention_mask: Tensor | None = None
    position_ids: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)
    documents: Documents | None = None
    score_positions: Tensor | None = None

    @staticmethod
    def packed(packed: Packed, **extras: Tensor) -> MicroBatch:
        """The micro-batch of a :func:`~.packing.pack` result, scoring its score positions."""
        return MicroBatch(
            packed.input_ids, None, packed.position_ids, extras, packed.documents, packed.score_positions
        )


def split_micro_batches(
    input_ids: Tensor,
    num: int,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    **extras: Tensor,
) -> list[MicroBatch]:
    """Cut a batch (and every per-sample tensor with it) into ``num`` equal micro-batches along dim 0."""
    batch = input_ids.shape[0]
    require(num >= 1 and batch % num == 0, "micro_batches", f"{num} does not divide the batch size {batch}")

    def cut(t: Tensor | None, i: int) -> Tensor | None:
        return None if t is None else t.chunk(num)[i]

    return [
        MicroBatch(
            input_ids.chunk(num)[i],
            cut(attention_mask, i),
            cut(position_ids, i),
            {k: v.chunk(num)[i] for k, v in extras.items()},
        )
        for i in range(num)
    ]


def _as_micro_batches(batch: Tensor | MicroBatch | Sequence[MicroBatch]) -> list[MicroBatch]:
    if isinstance(batch, Tensor):
        return [MicroBatch(batch)]
    if isinstance(batch, MicroBatch):
        return [batch]
    return list(batch)


def _hidden_buffer(model: ShardedCausalLM, mb: MicroBatch) -> Tensor:
    weight = next(model.parameters())
    b, s = mb.input_ids.shape
    return torch.empty(b, s, model.config.hidden_size, dtype=weight.dtype, device=weight.device)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over valid tokens only (0 on padding), as transformers ``generate`` does."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def recv_activation(buffer: Tensor, src: int) -> Tensor:
    """Receive a stage's activations from rank ``src`` into ``buffer``."""
    dist.recv(buffer, src=src)
    return buffer


def send_activation(t: Tensor, dst: int) -> None:
    """Send activations to the next stage's rank ``dst``."""
    dist.send(t.detach().contiguous(), dst=dst)


def _stage(model: ShardedCausalLM, mb: MicroBatch, hidden: Tensor | None, cache: Any = None) -> Tensor:
    return model.stage(mb.input_ids, hidden, mb.attention_mask, mb.position_ids, cache, mb.documents)


def pipeline_forward(
    model: ShardedCausalLM,
    micro_batches: Sequence[MicroBatch],
    head: Callable[[Tensor, MicroBatch], Tensor],
    cache: Any = None,
) -> list[Tensor] | None:
    """Forward every micro-batch through the pipeline (no autograd); ``head(hidden, mb)`` at the end.

    ``hidden``: the last stage's final hidden states ``[B, S, H]`` (its head is the caller's).

    ``cache``: a transformers KV cache this rank keeps for its own layers (one micro-batch only;
    see :meth:`ShardedCausalLM.stage`). Returns the list of head outputs on last-stage ranks and
    None elsewhere.
    """
    comm = model.comm
    require(cache is None or len(micro_batches) == 1, "cache", "a KV cache serves one micro-batch")
    outs: list[Tensor] = []
    with torch.no_grad(), fail_together():
        for mb in micro_batches:
            hidden = (
                None if comm.is_first_stage else recv_activation(_hidden_buffer(model, mb), comm.prev_rank)  # type: ignore[arg-type]
            )
            out = _stage(model, mb, hidden, cache)
            if comm.is_last_stage:
                outs.append(head(out, mb))
            else:
                send_activation(out, comm.next_rank)  # type: ignore[arg-type]
    return outs if comm.is_last_stage else None


def _deliver(model: ShardedCausalLM, value: Tensor | None, like: Tensor, where: Where) -> Tensor | None:
    """Move a last-stage result (shaped as ``like``) to ``where``: every replica rank, its first, or none."""
    comm = model.comm
    source = comm.ranks[(comm.layout.pp - 1) * comm.layout.tp]
    if where == "last":
        return value if comm.is_last_stage else None
    if where == "first":
        first = comm.ranks[0]
        if source != first:
            if comm.rank == source:
                send_activation(value, first)  # type: ignore[arg-type]
            elif comm.rank == first:
                value = recv_activation(torch.empty_like(like), source)
        return value if comm.rank == first else None
    buffer = value.contiguous() if comm.rank == source else torch.empty_like(like)  # type: ignore[union-attr]
    if comm.layout.size > 1:
        dist.broadcast(buffer, src=source, group=comm.replica_group)
    return buffer


def _like(
    model: ShardedCausalLM,
    micro_batches: Sequence[MicroBatch],
    last_dim: int | None,
    shift: int,
    dtype: torch.dtype,
    last: int = 0,
) -> Tensor:
    weight = next(model.parameters())
    b = sum(mb.input_ids.shape[0] for mb in micro_batches)
    s = micro_batches[0].input_ids.shape[1] - shift
    s = min(s, last) if last else s
    shape = (b, s) if last_dim is None else (b, s, last_dim)
    return torch.empty(shape, dtype=dtype, device=weight.device)


def forward_logits(
    model: ShardedCausalLM,
    batch: Tensor | MicroBatch | Sequence[MicroBatch],
    where: Where = "all",
    cache: Any = None,
    last: int = 0,
) -> Tensor | None:
    """Full-vocabulary logits ``[B, S, V]`` of the replica, concatenated over micro-batches.

    ``where``: "all" (every rank of the replica), "first" (the replica's first rank) or "last"
    (last-stage ranks); other ranks get None. ``cache``: see :func:`pipeline_forward`.
    ``last`` > 0: the last ``last`` positions only (``[B, last, V]``).
    """
    mbs = _as_micro_batches(batch)

    def head(hidden: Tensor, mb: MicroBatch) -> Tensor:
        return model.full_logits(model.local_logits(hidden[:, -last:] if last else hidden))

    with fail_together():
        outs = pipeline_forward(model, mbs, head, cache)
        value = None if outs is None else torch.cat(outs)
        like = _like(model, mbs, model.out_features, 0, next(model.parameters()).dtype, last)
        return _deliver(model, value, like, where)


def _require_lm(model: ShardedCausalLM) -> None:
    require(
        not model.value_head, "model", "a value model has no token log-probs; use forward_logits (values)"
    )


def head_outputs(
    model: ShardedCausalLM,
    hidden: Tensor,
    mb: MicroBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """What :func:`train_step` hands its loss, from the last stage's hidden states ``[B, S, H]``.

    Float32 token log-probs ``[B, S-1]`` of ``logits / temperature`` (entry ``t`` scores token
    ``t + 1``), or a value model's values ``[B, S]`` (its first label). With ``mb.score_positions``
    only those positions: ``[n]`` (log-probs of the token after each). ``with_entropy`` (LM only):
    ``(log_probs, entropy)`` of the same shape. Logits are never materialised for the whole
    vocabulary and batch at once (:func:`~.logprobs.head_logprobs`).
    """
    pos = mb.score_positions
    if model.value_head:
        values = model.local_logits(hidden)[..., 0].float()
        return values if pos is None else values.flatten()[pos]
    _require_lm(model)
    if pos is None:
        b, s = mb.input_ids.shape
        rows, targets = hidden[:, :-1].flatten(0, 1), mb.input_ids[:, 1:].flatten()
    else:
        rows, targets = hidden.flatten(0, 1)[pos], mb.input_ids.flatten()[pos + 1]
    log_probs, entropy = head_logprobs(model, rows, targets, temperature)
    if pos is None:
        log_probs, entropy = log_probs.view(b, s - 1), entropy.view(b, s - 1)
    return (log_probs, entropy) if with_entropy else log_probs


def _scores_like(model: ShardedCausalLM, mbs: Sequence[MicroBatch], rows: int) -> Tensor:
    weight = next(model.parameters())
    positions = [mb.score_positions for mb in mbs if mb.score_positions is not None]
    if len(positions) == len(mbs):
        n = sum(int(p.numel()) for p in positions)
        return torch.empty((rows, n), dtype=torch.float32, device=weight.device)
    require(
        not positions,
        "micro_batches",
        "score positions on some micro-batches only",
    )
    like = _like(model, mbs, None, 0 if model.value_head else 1, torch.float32)
    return like.new_empty((rows, *like.shape))


def token_scores(
    model: ShardedCausalLM,
    batch: Tensor | MicroBatch | Sequence[MicroBatch],
    where: Where = "all",
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tensor | None:
    """:func:`head_outputs` of every micro-batch (no autograd), concatenated, delivered to ``where``.

    Shape ``[k, B, S-1]`` (values: ``[k, B, S]``) or ``[k, n]`` with score positions, where ``k``
    is 2 with entropy (log-probs first) and 1 otherwise.
    """
    mbs = _as_micro_batches(batch)
    rows = 2 if with_entropy else 1

    def head(hidden: Tensor, mb: MicroBatch) -> Tensor:
        out = head_outputs(model, hidden, mb, temperature, with_entropy)
        return torch.stack(out) if isinstance(out, tuple) else out.unsqueeze(0)

    with fail_together():
        outs = pipeline_forward(model, mbs, head)
        value = None if outs is None else torch.cat(outs, dim=1)
        return _deliver(model, value, _scores_like(model, mbs, rows), where)


def token_logprobs(
    model: ShardedCausalLM, batch: Tensor | MicroBatch | Sequence[MicroBatch], where: Where = "all"
) -> Tensor | None:
    """``log p(input_ids[:, t+1] | input_ids[:, :t+1])`` as float32 ``[B, S-1]``, without gathering logits."""
    _require_lm(model)
    out = token_scores(model, batch, where)
    return None if out is None else out[0]


LossFn = Callable[[Any, MicroBatch], Tensor]


def _exchange(
    send: tuple[Tensor, int] | None = None, recv: tuple[Tensor, int] | None = None
) -> Tensor | None:
    """Send and/or receive (tensor, peer) at once; returns the received buffer."""
    if send is not None and recv is not None:
        ops = [
            dist.P2POp(dist.isend, send[0].detach().contiguous(), send[1]),
            dist.P2POp(dist.irecv, recv[0], recv[1]),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    elif send is not None:
        send_activation(*send)
    elif recv is not None:
        recv_activation(*recv)
    return None if recv is None else recv[0]


def train_step(
    model: ShardedCausalLM,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    max_grad_norm: float | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tensor:
    """One optimisation step of a replica: 1F1B forward + backward of every micro-batch, then gradient sync.

    ``loss_fn(outputs, mb)`` maps :func:`head_outputs` of a micro-batch (float32 ``[b, S-1]``
    token log-probs of ``logits / temperature``, ``[n]`` at its score positions; a value model's
    values; ``(log_probs, entropy)`` with ``with_entropy``) to a scalar; the objective is the
    mean over micro-batches. Gradients are summed over TP where needed, over tied-embedding
    copies, and averaged over ``model.comm.dp_group`` (so the objective is also the mean over
    replicas), clipped to a global norm of ``max_grad_norm`` when given
    (:func:`~nereus_lightning.models.optim.clip_grad_norm_`), then ``optimizer.step()`` when given
    (grads are left in ``.grad`` either way). Returns this replica's mean loss (float32 scalar) on
    every replica rank.
    """
    mbs = list(micro_batches)
    require(len(mbs) >= 1, "micro_batches", "need at least one micro-batch")
    with fail_together():
        return _one_step(model, mbs, loss_fn, optimizer, max_grad_norm, temperature, with_entropy)


def _one_step(
    model: ShardedCausalLM,
    mbs: list[MicroBatch],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    max_grad_norm: float | None,
    temperature: float,
    with_entropy: bool,
) -> Tensor:
    comm = model.comm
    params = list(model.parameters())
    for p in params:
        p.grad = None
    total = torch.zeros((), dtype=torch.float32, device=params[0].device)
    first, last = comm.is_first_stage, comm.is_last_stage
    prev, nxt = comm.prev_rank, comm.next_rank

    def forward(mb: MicroBatch, inp: Tensor | None) -> Tensor:
        out = _stage(model, mb, inp)
        if last:
            out = loss_fn(head_outputs(model, out, mb, temperature, with_entropy), mb) / len(mbs)
            total.add_(out.detach().float())
        return out

    def backward(inp: Tensor | None, out: Tensor, grad: Tensor | None) -> Tensor | None:
        torch.autograd.backward(out, grad)  # grad is None on the last stage: out is the loss
        return None if inp is None else inp.grad

    def recv_input(mb: MicroBatch) -> Tensor | None:
        return None if first else _exchange(recv=(_hidden_buffer(model, mb), prev)).requires_grad_()  # type: ignore[arg-type,union-attr]

    warmup = min(comm.layout.pp - comm.pp_rank - 1, len(mbs))
    steady = len(mbs) - warmup
    in_flight: deque[tuple[Tensor | None, Tensor]] = deque()
    for mb in mbs[:warmup]:
        inp = recv_input(mb)
        out = forward(mb, inp)
        _exchange(send=(out, nxt))  # type: ignore[arg-type]  # warm-up only on non-last stages
        in_flight.append((inp, out))
    inp = recv_input(mbs[warmup]) if steady > 0 else None
    for k in range(steady):
        out = forward(mbs[warmup + k], inp)
        in_flight.append((inp, out))
        old_inp, old_out = in_flight.popleft()
        grad = None if last else _exchange(send=(out, nxt), recv=(torch.empty_like(old_out), nxt))  # type: ignore[arg-type]
        grad_in = backward(old_inp, old_out, grad)
        if k == steady - 1:
            inp = None
            if not first:
                _exchange(send=(grad_in, prev))  # type: ignore[arg-type]
        elif first:
            inp = None
        else:
            nxt_mb = mbs[warmup + k + 1]
            inp = _exchange(send=(grad_in, prev), recv=(_hidden_buffer(model, nxt_mb), prev)).requires_grad_()  # type: ignore[arg-type,union-attr]
    while in_flight:
        old_inp, old_out = in_flight.popleft()
        grad = None if last else _exchange(recv=(torch.empty_like(old_out), nxt))  # type: ignore[arg-type]
        grad_in = backward(old_inp, old_out, grad)
        if not first:
            _exchange(send=(grad_in, prev))  # type: ignore[arg-type]
    model.sync_grads()
    if comm.dp_group is not None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_flat([p.grad for p in params], comm.dp_group, average=True)  # type: ignore[misc]
    if max_grad_norm is not None:
        clip_grad_norm_(model, max_grad_norm)
    if optimizer is not None:
        optimizer.step()
    loss = _deliver(model, total if last else None, total, "all")
    assert loss is not None
    return loss
