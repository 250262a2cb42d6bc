"""Fast decoding over one rank of a sharded replica: a static KV cache, and the decode step as a CUDA graph.

:class:`StaticDecodeEngine` is a :class:`~nereus_lightning.engines.base.RolloutEngine` over a
:class:`~nereus_lightning.models.ShardedCausalLM`. It samples exactly as
:class:`~nereus_lightning.engines.hf.HFGenerateEngine` over a
:class:`~nereus_lightning.models.generation.ShardedGenerator` (the eager reference, and the path
on the CPU): the same per-row seeded Gumbel draw, greedy without sampling, eos ends a row and
pad follows it, left-padded prompts whose positions skip the padding.

How (one :class:`StaticDecoder` per batch shape, kept per unit between calls):

- The KV cache is preallocated for the whole rollout (:class:`StaticKV`, this stage's layers only).
  The prompt sits at the end of a prompt region rounded up to :data:`PROMPT_BUCKET` slots, so that
  batches of similar prompt widths reuse one decoder; generated tokens follow it.
- The layers' 4D additive masks are built here from a static validity buffer and the step
  counter, one per attention kind (causal, sliding window): transformers' mask helpers branch on
  data, which a replayed graph cannot.
- The prefill runs eagerly. Each decode step is two functions on static buffers: the stage's
  forward (the last stage also picks the next token) and the bookkeeping (eos, padding, the
  response, the step counter), each replayed as a CUDA graph on CUDA and called directly on the
  CPU. TP collectives run inside the forward (captured on NCCL); between pipeline stages the
  hidden states go point-to-point and the last stage broadcasts the token ids, outside the graphs.
- In ``"compiled"`` mode (the default on CUDA) the stage's forward goes through ``torch.compile``
  before it is captured: inductor fuses each layer's norms, rotary embedding, activation and
  residual adds, which are most of a decode step's ~30 kernels per layer. Its sdpa attention is
  :func:`decode_attention` (:data:`DECODE_ATTENTION`): transformers packs a one-token query onto
  the key/value heads only outside torch.compile and repeats the keys and values inside it, which
  costs more than the fusion saves. The sampling stays as written (its 64-bit hash arithmetic is
  the reference's, bit for bit).
- Every rank leaves the loop at the same step: they see the same tokens. The loop looks at the
  ``done`` flags every :data:`SYNC_EVERY` steps only (one host sync each); steps after every row
  ended write padding, as ``generate``'s output would hold.

A decoder's graphs read the unit's parameters at the addresses they had at capture; a decoder is
rebuilt when any parameter or buffer moved (new tensors, another device or dtype). Updates made in
place (an optimizer step, weights synchronised in place) are seen by the next replay.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from nereus_lightning.engines.base import GOLDEN, RolloutOutput, SeededGumbel, finish_rollout, make_picker
from nereus_lightning.models.fail_fast import fail_together
from nereus_lightning.models.pipeline import position_ids_from_mask, recv_activation, send_activation
from nereus_lightning.models.sharded import ShardedCausalLM, attention_kinds
from nereus_lightning.spec.errors import NereusConfigError, require

#: The prompt region of the cache is a multiple of this many slots (batches of similar widths share a
#: decoder).
PROMPT_BUCKET = 64
#: How often (in decoded tokens) the loop checks whether every row has ended.
SYNC_EVERY = 8
#: The decode modes a caller may offer: ``"auto"`` (compiled on CUDA, eager elsewhere), ``"eager"``,
#: ``"static"`` (static cache and CUDA graphs), ``"compiled"`` (the same, the stage's forward compiled).
DECODE_MODES = ("auto", "eager", "static", "compiled")


class StaticKV:
    """Preallocated keys and values ``[B, kv_heads, slots, head_dim]`` of one stage's layers (a KV cache).

    The family's attention calls :meth:`update` with its global layer index; the new keys and
    values are written at :attr:`slots` and the first :attr:`length` slots are returned (the masks
    hide the slots not yet written or padding).
    """

    def __init__(self, unit: ShardedCausalLM, batch: int, slots: int) -> None:
        cfg, weight = unit.local_config, next(unit.parameters())
        shape = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
        # Zeros, not empty: masked slots are multiplied by zero weights, and 0 * NaN is NaN.
        self.keys = {i: weight.new_zeros(shape) for i in unit.layer_ids}
        self.values = {i: weight.new_zeros(shape) for i in unit.layer_ids}
        self.slots = torch.zeros(1, dtype=torch.long, device=weight.device)
        self.length = slots

    def update(
        self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write ``key``/``value`` ``[B, kv_heads, S, head_dim]`` at :attr:`slots`; returns all so far."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key)
        values.index_copy_(2, self.slots, value)
        return keys[:, :, : self.length], values[:, :, : self.length]


def additive_masks(config: Any, valid: Tensor, query_slots: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """The layers' 4D additive masks ``[B, 1, S, K]`` by attention kind, for queries at ``query_slots``.

    ``query_slots`` is ``[S]``; ``valid`` ``[B, K]``: which cache slots hold tokens (not padding). A
    query at slot ``q`` sees a valid slot ``k <= q`` (and ``k > q - sliding_window`` on sliding
    layers), as transformers' masks do.
    """
    kv = torch.arange(valid.shape[-1], device=valid.device)
    q = query_slots.view(-1, 1)
    causal = valid.unsqueeze(1) & (kv <= q)  # [B, S, K]
    masks = {}
    for kind in attention_kinds(config):
        seen = causal & (kv > q - config.sliding_window) if kind == "sliding_attention" else causal
        blocked = torch.zeros(seen.shape, dtype=dtype, device=valid.device)
        masks[kind] = blocked.masked_fill_(~seen, torch.finfo(dtype).min).unsqueeze(1)
    return masks


def seeded_scores(pick: SeededGumbel, logits: Tensor, seeds: Tensor, step: Tensor) -> Tensor:
    """``pick``'s scores of ``logits`` ``[B, V]`` at decoding step ``step`` (0-d, so a graph can replay it).

    The draw of (seed, step) is the draw of (seed + step * golden, step 0): ``gumbel_noise`` mixes
    ``seed + (step + 1) * golden`` (modulo 2^64), so shifting the seeds moves the step (a test pins this).
    ``pick`` is built for prompts of width 0, so the ``[B, 0]`` ids it is given read as step 0.
    """
    pick._seeds = seeds + step * GOLDEN
    return pick(logits.new_empty((logits.shape[0], 0), dtype=torch.long), logits)


#: The attention implementation (transformers' registry) of a compiled decode step's sdpa layers.
DECODE_ATTENTION = "nereus_decode_sdpa"


def decode_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' sdpa attention, a one-token GQA query packed onto the key/value heads.

    The query's ``heads`` rows become ``kv_heads x groups`` query rows of the key/value heads (the
    additive mask ``[B, 1, 1, K]`` broadcasts over them): the same products as repeating the keys
    and values, without writing them. Anything else goes to transformers' sdpa as is.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1  # cannot be packed
    if query.shape[2] != 1 or groups == 1 or per_head_mask or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)


@contextmanager
def decode_attention_for(unit: ShardedCausalLM) -> Iterator[None]:
    """The unit's sdpa layers on :func:`decode_attention` for the block (tracing a compiled step).

    Only while the step is compiled and captured: a captured graph never looks at the setting
    again, and every other caller of the unit keeps transformers' own sdpa.
    """
    config = unit.local_config
    kept = config._attn_implementation
    if kept == "sdpa":
        config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = kept


def capture(fn: Callable[[], None], pool: Any) -> Callable[[], None]:
    """``fn`` (reading and writing static tensors only) as a CUDA graph; its replay.

    ``fn`` runs once on a side stream first (lazy initialisation: cuBLAS workspaces, NCCL
    communicators), as torch's graph recipe asks; so it must tolerate running on stale buffers.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread may query its events while this thread captures.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        fn()
    return graph.replay


@dataclass(frozen=True)
class DecodeShape:
    """What a decoder's buffers and graphs are built for."""

    batch: int
    prompt_slots: int  # the prompt region, a multiple of PROMPT_BUCKET
    max_new_tokens: int
    sampling: tuple[float, int, float] | None  # (temperature, top_k, top_p); None: greedy
    eos_token_id: int | None  # None: every row runs to max_new_tokens
    pad_token_id: int
    compiled: bool = False  # the stage's forward through torch.compile

    @property
    def slots(self) -> int:
        """Cache slots: the prompt region and every generated token but the last (never fed back)."""
        return self.prompt_slots + self.max_new_tokens - 1


def _fingerprint(unit: ShardedCausalLM) -> tuple[tuple[int, torch.dtype, torch.device], ...]:
    """Where the unit's tensors live: a captured graph reads them there."""
    tensors = (*unit.parameters(), *unit.buffers())
    return tuple((t.data_ptr(), t.dtype, t.device) for t in tensors)


class StaticDecoder:
    """Static buffers, cache and (on CUDA) graphs of one rank for one :class:`DecodeShape`.

    Holds no reference to the unit (it is kept per unit, weakly); every call is given it.
    Drive it with :meth:`start` (prefill, token 0), then :meth:`step` (one token each) while
    :attr:`emitted` < ``max_new_tokens``; :attr:`logits` holds the last step's full-vocabulary logits
    on the last stage.
    """

    @torch.no_grad()
    def __init__(self, unit: ShardedCausalLM, shape: DecodeShape, pick: SeededGumbel | None) -> None:
        weight = next(unit.parameters())
        device, b = weight.device, shape.batch
        self.shape, self.pick, self.dtype = shape, pick, weight.dtype
        self.fingerprint = _fingerprint(unit)
        self.kv = StaticKV(unit, b, shape.slots)
        self.valid = torch.zeros(b, shape.slots, dtype=torch.bool, device=device)
        self.first_position = torch.zeros(b, dtype=torch.long, device=device)
        self.seeds = torch.zeros(b, dtype=torch.long, device=device)
        self.emitted = torch.zeros((), dtype=torch.long, device=device)  # tokens emitted so far
        self.tokens = torch.zeros(b, 1, dtype=torch.long, device=device)  # the step's input token
        self.next_token = torch.zeros(b, dtype=torch.long, device=device)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.response = torch.zeros(b, shape.max_new_tokens, dtype=torch.long, device=device)
        hidden = (b, 1, unit.config.hidden_size)
        self.hidden_in = weight.new_zeros(hidden)
        self.hidden_out = weight.new_zeros(hidden)
        self.logits = weight.new_zeros(b, unit.out_features)
        self._stage = compiled_stage() if shape.compiled else ShardedCausalLM.stage
        self._forward: Callable[[ShardedCausalLM], None] = self._decode_forward
        self._record: Callable[[ShardedCausalLM], None] = lambda unit: self._record_token()
        if shape.compiled:  # traced with the packed attention; guards see the same setting each time
            self._forward = self._compiled_forward
        if device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
            forward = capture(lambda: self._forward(unit), pool)
            record = capture(self._record_token, pool)
            self._forward = lambda unit: forward()
            self._record = lambda unit: record()

    @torch.no_grad()
    def start(
        self, unit: ShardedCausalLM, prompt_ids: Tensor, prompt_mask: Tensor, seeds: Sequence[int] | None
    ) -> None:
        """Load left-padded prompts (and the rows' sampling seeds), run the prefill and emit token 0."""
        shape, comm = self.shape, unit.comm
        width = prompt_ids.shape[1]
        offset = shape.prompt_slots - width
        self.valid.fill_(True)
        self.valid[:, :offset] = False
        self.valid[:, offset : shape.prompt_slots] = prompt_mask.bool()
        self.first_position.copy_(prompt_mask.sum(-1))
        if seeds is not None:
            self.seeds.copy_(torch.tensor(list(seeds), dtype=torch.long))
        self.emitted.zero_()
        self.done.zero_()
        self.response.fill_(shape.pad_token_id)
        slots = torch.arange(offset, shape.prompt_slots, device=self.valid.device)
        self.kv.slots, self.kv.length = slots, shape.prompt_slots
        masks = additive_masks(unit.local_config, self.valid[:, : shape.prompt_slots], slots, self.dtype)
        hidden = None
        if comm.prev_rank is not None:  # not the first stage
            hidden = recv_activation(
                self.hidden_in.new_empty(shape.batch, width, self.hidden_in.shape[-1]), comm.prev_rank
            )
        hidden = unit.stage(prompt_ids, hidden, masks, position_ids_from_mask(prompt_mask), self.kv)
        if comm.next_rank is None:  # the last stage
            self._pick_token(unit, hidden[:, -1:])
        else:
            send_activation(hidden, comm.next_rank)
        self._share_token(unit)
        self._record(unit)

    @torch.no_grad()
    def step(self, unit: ShardedCausalLM) -> None:
        """Decode one token: the previous one through the stages, then pick, share and record the next."""
        comm = unit.comm
        if comm.prev_rank is not None:  # not the first stage
            recv_activation(self.hidden_in, comm.prev_rank)
        self._forward(unit)
        if comm.next_rank is not None:  # not the last stage
            send_activation(self.hidden_out, comm.next_rank)
        self._share_token(unit)
        self._record(unit)

    def finished(self) -> bool:
        """Whether every row has ended (a host sync)."""
        return bool(self.done.all())

    def _compiled_forward(self, unit: ShardedCausalLM) -> None:
        """:meth:`_decode_forward` through :func:`compiled_stage`, on :func:`decode_attention`."""
        from torch._dynamo.exc import BackendCompilerFailed

        try:
            with decode_attention_for(unit):
                self._decode_forward(unit)
        except BackendCompilerFailed as exc:  # e.g. no C compiler or Triton for inductor
            raise NereusConfigError(
                "algorithm.decode: torch.compile could not compile the decode step "
                f"({exc.inner_exception!r}); set algorithm.decode=static to capture it uncompiled"
            ) from exc

    def _decode_forward(self, unit: ShardedCausalLM) -> None:
        """The stage's forward of the input token at its slot (graph body: static tensors only)."""
        slot = (self.shape.prompt_slots - 1 + self.emitted).view(1)
        positions = (self.first_position + self.emitted - 1).unsqueeze(-1)
        self.kv.slots, self.kv.length = slot, self.shape.slots
        masks = additive_masks(unit.local_config, self.valid, slot, self.dtype)
        hidden = self._stage(unit, self.tokens, self.hidden_in, masks, positions, self.kv)
        if unit.comm.is_last_stage:
            self._pick_token(unit, hidden)
        else:
            self.hidden_out.copy_(hidden)

    def _pick_token(self, unit: ShardedCausalLM, hidden: Tensor) -> None:
        """The last position's full logits into :attr:`logits`, the picked token into :attr:`next_token`."""
        self.logits.copy_(unit.full_logits(unit.local_logits(hidden))[:, -1])
        scores = (
            self.logits
            if self.pick is None
            else seeded_scores(self.pick, self.logits, self.seeds, self.emitted)
        )
        self.next_token.copy_(scores.argmax(-1))

    def _share_token(self, unit: ShardedCausalLM) -> None:
        """The last stage's token ids to every rank of the replica (TP ranks of one stage already agree)."""
        comm = unit.comm
        if comm.layout.pp > 1:
            source = comm.ranks[(comm.layout.pp - 1) * comm.layout.tp]
            dist.broadcast(self.next_token, src=source, group=comm.replica_group)

    def _record_token(self) -> None:
        """Emit :attr:`next_token` (pad after eos) as the next response token and input (graph body)."""
        emitted = torch.where(self.done, self.shape.pad_token_id, self.next_token)
        self.response.index_copy_(1, self.emitted.view(1), emitted.unsqueeze(-1))
        if self.shape.eos_token_id is not None:
            self.done |= emitted == self.shape.eos_token_id
        self.tokens.copy_(emitted.unsqueeze(-1))
        self.emitted += 1


def stop_compile_workers() -> threading.Thread | None:
    """Shut torch.compile's worker processes down on a thread of their own (None if none were started).

    At the end of training they are not needed: their shutdown took 1.2 s after a 0.5B run on an
    H200 host as an exit callback, after the final checkpoint; on this thread it runs while the
    checkpoint is written. A later compile starts them again. Join the thread before exiting.
    """
    workers = sys.modules.get("torch._inductor.async_compile")  # only once inductor was used
    if workers is None:
        return None
    thread = threading.Thread(target=workers.shutdown_compile_workers, name="nereus-compile-workers")
    thread.start()
    return thread


@functools.cache
def compiled_stage() -> Callable[..., Tensor]:
    """:meth:`ShardedCausalLM.stage` through ``torch.compile`` (one wrapper: its compiled graphs are
    shared by every unit of one structure and shape)."""
    return torch.compile(ShardedCausalLM.stage, dynamic=False)


def decode_path(mode: str, unit: ShardedCausalLM) -> str:
    """How decode mode ``mode`` (:data:`DECODE_MODES`) runs ``unit``: ``"eager"``, ``"static"`` or
    ``"compiled"``."""
    require(
        mode in DECODE_MODES,
        "algorithm.decode",
        f"{mode!r} is not one of {', '.join(map(repr, DECODE_MODES))}",
    )
    if mode != "auto":
        return mode
    return "compiled" if next(unit.parameters()).device.type == "cuda" else "eager"


#: One decoder per unit (the latest shape it decoded), dropped with the unit.
_DECODERS: weakref.WeakKeyDictionary[ShardedCausalLM, StaticDecoder] = weakref.WeakKeyDictionary()


def decoder_for(unit: ShardedCausalLM, shape: DecodeShape, pick: SeededGumbel | None) -> StaticDecoder:
    """The unit's decoder for ``shape``, rebuilt when the shape changed or the unit's tensors moved."""
    held = _DECODERS.get(unit)
    if held is None or held.shape != shape or held.fingerprint != _fingerprint(unit):
        _DECODERS.pop(unit, None)  # free the old buffers and graphs before allocating new ones
        held = _DECODERS[unit] = StaticDecoder(unit, shape, pick)
    return held


def release_decoder(unit: ShardedCausalLM) -> None:
    """Free the unit's decoder (its KV cache and graphs), e.g. before moving idle weights to the host."""
    _DECODERS.pop(unit, None)


class StaticDecodeEngine:
    """A rollout engine over one rank of a sharded replica: static KV cache, CUDA-graph decode steps.

    Every rank of the replica calls :meth:`generate` with the same prompts and gets the same
    responses, as with :class:`~nereus_lightning.engines.hf.HFGenerateEngine` over a
    :class:`~nereus_lightning.models.generation.ShardedGenerator`, whose tokens it samples.

    Args:
        unit: this rank's :class:`ShardedCausalLM` of the generation replica.
        eos_token_id: id that ends a response; None: responses run to ``max_new_tokens`` (``ignore_eos``).
        pad_token_id: id written after a response's end.
        compiled: the stage's forward through ``torch.compile`` (decode mode ``"compiled"``).
    """

    def __init__(
        self, unit: ShardedCausalLM, eos_token_id: int | None, pad_token_id: int, compiled: bool = False
    ) -> None:
        require(
            not unit.value_head, "rollout.engine", "a value model (token classification) does not generate"
        )
        self.unit = unit
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.compiled = compiled

    @torch.no_grad()
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
        batch, width = prompt_ids.shape
        require(
            bool(attention_mask[:, -1].all()),
            "attention_mask",
            "prompts must be left-padded: the last column must hold a token in every row",
        )
        pick = make_picker(batch, 0, max_new_tokens, do_sample, temperature, top_k, top_p, sample_seeds)
        shape = DecodeShape(
            batch,
            PROMPT_BUCKET * math.ceil(width / PROMPT_BUCKET),
            max_new_tokens,
            None if pick is None else (pick.temperature, pick.top_k, pick.top_p),
            self.eos_token_id,
            self.pad_token_id,
            self.compiled,
        )
        device = next(self.unit.parameters()).device
        with fail_together():
            decoder = decoder_for(self.unit, shape, pick)
            decoder.start(
                self.unit,
                prompt_ids.to(device),
                attention_mask.to(device),
                None if pick is None else pick.seeds,
            )
            for emitted in range(1, max_new_tokens):
                if emitted % SYNC_EVERY == 0 and decoder.finished():
                    break
                decoder.step(self.unit)
            response = decoder.response.to(prompt_ids.device, copy=True)
        return finish_rollout(
            prompt_ids, attention_mask, response, max_new_tokens, self.eos_token_id, self.pad_token_id
        )
