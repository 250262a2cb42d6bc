"""Pack many strided views into one flat byte buffer, and unpack it again.

This torch implementation is the contract: any device kernel must produce the same bytes.
Views may have any shape, strides and dtype; each starts at a 16-byte aligned offset so that
mixed dtypes (bf16 weights, fp32 optimizer state) travel in one buffer per peer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def pack(views: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy ``views`` one after another into a flat ``uint8`` buffer (allocated on their device if ``out`` is None)."""
    offsets, total = byte_offsets(views)
    if out is None:
        device = views[0].device if views else torch.device("cpu")
        out = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ValueError(f"pack: out must be a 1-D uint8 tensor of at least {total} bytes, got {out.dtype} {tuple(out.shape)}")
    for view, offset in zip(views, offsets):
        _slot(out, offset, view).copy_(view)
    return out


def unpack(buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slots of ``buffer`` (as laid out by :func:`pack`) into the strided ``views``."""
    offsets, total = byte_offsets(views)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < total:
        raise ValueError(f"unpack: buffer must be a 1-D uint8 tensor of at least {total} bytes, got {buffer.dtype} {tuple(buffer.shape)}")
    for view, offset in zip(views, offsets):
        view.copy_(_slot(buffer, offset, view))
