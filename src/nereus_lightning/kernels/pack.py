"""Pack many strided views into one flat byte buffer, and unpack it again.

The torch implementation here (:func:`pack_reference`, :func:`unpack_reference`) is the contract:
the fused GPU kernels (``cuda/``, loaded by :mod:`._ext`) must produce the same
bytes. Views may have any shape, strides and dtype; each starts at a 16-byte aligned offset so that
mixed dtypes (bf16 weights, fp32 optimizer state) travel in one buffer per peer. Only a slot's own
bytes are written; the padding up to the next 16-byte offset is left as it was. Destination views
of one unpack must not overlap each other.

:func:`pack` and :func:`unpack` dispatch: when the buffer and all views are on one GPU, one kernel
launch copies them all; otherwise (CPU tensors, no GPU, kernels unavailable) the reference runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import increment_version

from nereus_lightning.kernels import _ext

ALIGN = 16


def byte_offsets(views: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offset of each view in the packed buffer, and the buffer's total size in bytes."""
    offsets: list[int] = []
    pos = 0
    for view in views:
        offsets.append(pos)
        nbytes = view.numel() * view.element_size()
        pos += -(-nbytes // ALIGN) * ALIGN
    return offsets, pos


def _slot(buffer: torch.Tensor, offset: int, view: torch.Tensor) -> torch.Tensor:
    nbytes = view.numel() * view.element_size()
    return buffer[offset : offset + nbytes].view(view.dtype).view(view.shape)


def _packed_buffer(views: Sequence[torch.Tensor], out: torch.Tensor | None, total: int) -> torch.Tensor:
    if out is None:
        device = views[0].device if views else torch.device("cpu")
        return torch.empty(total, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ValueError(
            f"pack: out must be a 1-D uint8 tensor of at least {total} bytes, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    return out


def _check_buffer(buffer: torch.Tensor, total: int) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < total:
        raise ValueError(
            f"unpack: buffer must be a 1-D uint8 tensor of at least {total} bytes, "
            f"got {buffer.dtype} {tuple(buffer.shape)}"
        )


def pack_reference(views: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`pack` with one torch copy per view (the contract; any device)."""
    offsets, total = byte_offsets(views)
    out = _packed_buffer(views, out, total)
    for view, offset in zip(views, offsets, strict=True):
        _slot(out, offset, view).copy_(view)
    return out


def unpack_reference(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """:func:`unpack` with one torch copy per view (the contract; any device)."""
    offsets, total = byte_offsets(views)
    _check_buffer(buffer, total)
    for view, offset in zip(views, offsets, strict=True):
        view.copy_(_slot(buffer, offset, view))


def pack(views: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``views`` one after another into a flat ``uint8`` buffer (``out``, else one on their device)."""
    _, total = byte_offsets(views)
    out = _packed_buffer(views, out, total)
    if out.is_cuda:
        if _ext.copy_views(views, out, pack=True):
            return out
    else:
        _ext.note_reference_use()
    return pack_reference(views, out)


def unpack(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slots of ``buffer`` (as laid out by :func:`pack`) into the strided ``views``."""
    _, total = byte_offsets(views)
    _check_buffer(buffer, total)
    if buffer.is_cuda:
        if _ext.copy_views(views, buffer, pack=False):
            for view in views:  # the kernel writes through pointers: count the writes as torch's copy_ does
                increment_version(view)
            return
    else:
        _ext.note_reference_use()
    unpack_reference(buffer, views)
