"""Sequences packed end to end in one row, without padding, and attention that keeps them apart.

:func:`pack` lays the valid tokens of a padded batch end to end (``[1, T]``), restarts the
positions at every sequence, and records the sequence bounds (:class:`Documents`). A packed
forward runs each attention layer as :func:`packed_attention`: causal attention within each
sequence (and its sliding window, for the layers that slide), never across, which is exactly what
the padded batch computes. Outputs come back to the padded layout with :meth:`Packed.unpack`.

:func:`token_budget_slices` cuts a batch into micro-batches by a token budget (verl's
``ppo_max_token_len_per_gpu`` idea) instead of a count of padded sequences.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from nereus_lightning.spec.errors import NereusConfigError, require

log = logging.getLogger(__name__)

#: The attention implementation (transformers' registry) of a packed forward's layers.
PACKED_ATTENTION = "nereus_packed_sdpa"
#: Attention implementations a packed forward replaces (both compute plain softmax attention).
_PACKABLE = ("sdpa", "eager")
#: Attention arguments the packed attention cannot honour: a family that passes one is refused.
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


@dataclass(frozen=True)
class Documents:
    """The sequences of one packed row: ``bounds[i]:bounds[i + 1]`` is sequence ``i`` (host ints)."""

    bounds: tuple[int, ...]

    def spans(self) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` of every non-empty sequence."""
        for start, stop in zip(self.bounds[:-1], self.bounds[1:], strict=False):
            if stop > start:
                yield start, stop


@dataclass(frozen=True)
class Packed:
    """A packed row (``input_ids``, ``position_ids`` ``[1, T]``) and the way back to the padded batch.

    ``score_positions`` ``[n]``: packed positions whose outputs the caller asked for (the
    ``score_mask`` of :func:`pack`, in row-major order); ``rows``/``cols`` are their places in the
    padded ``[B, S]`` batch.
    """

    input_ids: Tensor
    position_ids: Tensor
    documents: Documents
    score_positions: Tensor
    rows: Tensor
    cols: Tensor
    shape: tuple[int, int]

    def unpack(self, values: Tensor) -> Tensor:
        """Per-score-position ``values`` ``[n, ...]`` in the padded ``[B, S, ...]`` layout, zero elsewhere."""
        out = values.new_zeros(*self.shape, *values.shape[1:])
        out[self.rows, self.cols] = values
        return out


def pack(input_ids: Tensor, attention_mask: Tensor, score_mask: Tensor | None = None) -> Packed:
    """Pack the valid tokens (``attention_mask`` 1) of ``input_ids`` ``[B, S]`` into one row, in row order.

    ``score_mask`` ``[B, S]`` (a subset of the valid tokens) marks the positions whose outputs the
    caller will read back; by default every valid token but each sequence's last (those that have a
    next token to score). Positions count each sequence's valid tokens from 0, as
    transformers ``generate`` does for a left-padded prompt.
    """
    valid = attention_mask.bool()
    lengths = valid.sum(-1)
    flat = valid.flatten().nonzero().squeeze(-1)
    total = int(flat.numel())
    bounds = [0, *torch.cumsum(lengths, 0).tolist()]
    starts = torch.repeat_interleave(torch.tensor(bounds[:-1], device=flat.device), lengths.to(flat.device))
    positions = torch.arange(total, device=flat.device) - starts
    score = _all_but_last(valid) if score_mask is None else score_mask.bool()
    if bool((score & ~valid).any()):
        raise NereusConfigError("score_mask: marks padding positions; it must be a subset of attention_mask")
    packed_of = torch.full((valid.numel(),), -1, dtype=torch.long, device=flat.device)
    packed_of[flat] = torch.arange(total, device=flat.device)
    wanted = score.flatten().nonzero().squeeze(-1)
    width = input_ids.shape[1]
    return Packed(
        input_ids.flatten()[flat].unsqueeze(0),
        positions.unsqueeze(0),
        Documents(tuple(int(b) for b in bounds)),
        packed_of[wanted],
        wanted // width,
        wanted % width,
        (input_ids.shape[0], width),
    )


def _all_but_last(valid: Tensor) -> Tensor:
    """``valid`` without each row's last valid token."""
    last = valid.shape[1] - 1 - valid.flip(-1).long().argmax(-1)
    out = valid.clone()
    out[torch.arange(valid.shape[0], device=valid.device), last] = False
    return out & valid


def token_budget_slices(lengths: Sequence[int], budget: int) -> list[slice]:
    """Consecutive rows grouped so that each group's tokens stay within ``budget``.

    A row longer than the budget is a micro-batch of its own (it cannot be cut).
    """
    slices: list[slice] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            slices.append(slice(start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        slices.append(slice(start, len(lengths)))
    return slices


def packing_refusal(local_config: Any) -> str | None:
    """Why a unit with this (local) config cannot run packed forwards, or None when it can."""
    impl = local_config._attn_implementation or "sdpa"
    if impl not in _PACKABLE:
        return f"attention implementation {impl!r} (packed forwards replace {' or '.join(_PACKABLE)})"
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(local_config, name, None) is not None:
            return f"{name}={getattr(local_config, name)} (not computed by the packed attention)"
    return None


def _window_mask(n: int, window: int, device: torch.device) -> Tensor:
    """Causal and within ``window``, as transformers slides: query i sees key j iff i - window < j <= i."""
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    nereus_documents: Documents | None = None,
    nereus_varlen: Varlen | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Softmax attention of ``[1, heads, T, D]`` tensors within each packed sequence.

    One FlashAttention varlen call where :func:`varlen_of` gave its arguments (``nereus_varlen``: no
    host data, so a compiled stage traces it), else sdpa per sequence of ``nereus_documents``.
    """
    unsupported = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if unsupported or (nereus_documents is None and nereus_varlen is None):
        what = f"attention arguments {unsupported}" if unsupported else "no packed documents"
        raise NereusConfigError(f"packed attention: {what}; this family must run padded micro-batches")
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    if nereus_varlen is not None and dropout == 0.0:
        return _varlen(query, key, value, nereus_varlen, scaling, window), None
    require(nereus_documents is not None, "documents", "attention dropout needs the packed documents")
    return _per_sequence(query, key, value, nereus_documents, dropout, scaling, window), None  # type: ignore[arg-type]


def _per_sequence(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    documents: Documents,
    dropout: float,
    scaling: float | None,
    window: int | None,
) -> Tensor:
    """:func:`packed_attention` as one sdpa call per sequence (every device; the reference)."""
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for start, stop in documents.spans():
        q, k, v = (t[:, :, start:stop] for t in (query, key, value))
        causal = window is None or stop - start <= window
        mask = None if causal else _window_mask(stop - start, window, query.device)  # type: ignore[arg-type]
        outs.append(
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=gqa
            )
        )
    out = torch.cat(outs, dim=2) if outs else query.new_zeros(query.shape[:3] + value.shape[-1:])
    return out.transpose(1, 2).contiguous()


class Varlen(NamedTuple):
    """The varlen kernel's view of a packed row: ``cu_seqlens`` on the device and the longest sequence.

    A tuple, so that a compiled stage takes the length as a dynamic int rather than guarding on it.
    """

    bounds: Tensor
    longest: int


def varlen_of(documents: Documents, device: torch.device, dtype: torch.dtype) -> Varlen | None:
    """The varlen kernel's arguments for ``documents`` where it runs (``device``, ``dtype``), else None."""
    if device.type != "cuda" or not _varlen_works(device, dtype):
        return None
    return varlen_args(documents, device)


def varlen_args(documents: Documents, device: torch.device) -> Varlen:
    """:class:`Varlen` of ``documents`` on ``device``."""
    longest = max((b - a for a, b in documents.spans()), default=0)
    return Varlen(_device_bounds(documents.bounds, device), longest)


def _varlen(
    query: Tensor, key: Tensor, value: Tensor, varlen: Varlen, scaling: float | None, window: int | None
) -> Tensor:
    """:func:`packed_attention` as one FlashAttention varlen call (``torch.nn.attention.varlen``, CUDA)."""
    from torch.nn.attention.varlen import varlen_attn

    groups = query.shape[1] // key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    if groups > 1:  # the kernel's own GQA is not in every torch version that has it
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bounds, longest = varlen.bounds, varlen.longest
    left = -1 if window is None else window - 1  # transformers: i - window < j <= i
    out: Tensor = varlen_attn(  # type: ignore[assignment]  # a tensor without return_aux
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        bounds,
        bounds,
        longest,
        longest,
        scale=scaling,
        window_size=(left, 0),
    )
    return out.unsqueeze(0)


@lru_cache(maxsize=64)
def _device_bounds(bounds: tuple[int, ...], device: torch.device) -> Tensor:
    """The kernel's ``cu_seqlens`` on ``device``, copied once per packed row: a host-to-device copy per
    layer would wait for the GPU at every layer (and again in a recomputed forward)."""
    return torch.tensor(bounds, dtype=torch.int32, device=device)


@cache
def _varlen_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs :func:`_varlen` on ``device`` and ``dtype``, checked once against
    :func:`_per_sequence` (forward and backward) on a small packed batch; else per-sequence sdpa."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        if "window_size" not in inspect.signature(varlen_attn).parameters:
            return False
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(1, h, 40, 64, device=device, generator=gen, dtype=dtype).requires_grad_()
            for h in (4, 2, 2)
        )
        docs = Documents((0, 7, 7, 30, 40))
        with torch.enable_grad():  # the first use may be in a no-grad pass
            ok = all(
                _agree(
                    _per_sequence(q, k, v, docs, 0.0, 0.125, w),
                    _varlen(q, k, v, varlen_args(docs, device), 0.125, w),
                    (q, k, v),
                )
                for w in (None, 9)
            )
    except Exception as exc:  # noqa: BLE001  # any failure means: use the per-sequence path
        log.info("packed attention: varlen kernel unavailable (%s); one sdpa call per sequence", exc)
        return False
    if not ok:
        log.warning(
            "packed attention: the varlen kernel disagrees with sdpa here; one sdpa call per sequence"
        )
    return ok


def _agree(ref: Tensor, fast: Tensor, inputs: tuple[Tensor, ...]) -> bool:
    """Whether two attention outputs and their gradients w.r.t. ``inputs`` agree to bf16 rounding."""
    pairs = [(ref, fast)]
    grads = [torch.autograd.grad(out.float().square().sum(), inputs) for out in (ref, fast)]
    pairs += list(zip(*grads, strict=True))
    return all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in pairs)


@cache
def _registered() -> None:
    """Register :func:`packed_attention` with transformers (once, on first use: importing this package
    does not import transformers)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


@contextmanager
def packed_attention_for(local_config: Any) -> Iterator[None]:
    """The unit's attention layers on :func:`packed_attention` for the block (one layer call)."""
    _registered()
    kept = local_config._attn_implementation
    local_config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        local_config._attn_implementation = kept
