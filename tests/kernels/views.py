"""Random strided views for pack/unpack tests: slices of 'parameters' of many dtypes and layouts."""

from __future__ import annotations

import random

import torch

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
POISON = 0xAB


def _param(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A parameter with random bytes (never zeros: unwritten outputs must show)."""
    nbytes = max(1, torch.Size(shape).numel()) * torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1  # other bytes are not valid bools; any float bytes (NaN payloads too) are fine
    return raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape).to(device)


def random_view(
    rng: random.Random, device: str = "cpu", writable: bool = True, small: bool = False
) -> torch.Tensor:
    """A view of a fresh parameter: row/column blocks, steps, transposes, 3-D+ slices, offsets, empties."""
    dtype = rng.choice(DTYPES)
    big = 4 if small else 96
    kind = rng.choice(("full", "cols", "rows", "step", "t", "nd", "odd", "scalar", "empty", "8d", "expand"))
    if kind == "expand" and writable:
        kind = "cols"
    r, c = rng.randint(1, big), rng.randint(1, big)
    if kind == "full":
        return _param(rng, (r, c), dtype, device)
    if kind == "cols":  # a row-parallel shard: a column block of a 2-D weight
        p = _param(rng, (r, c + 3), dtype, device)
        a = rng.randint(0, 3)
        return p[:, a : a + rng.randint(1, c)]
    if kind == "rows":  # a column-parallel shard: a row block
        p = _param(rng, (r + 2, c), dtype, device)
        a = rng.randint(0, 2)
        return p[a : a + rng.randint(1, r)]
    if kind == "step":
        p = _param(rng, (r + 1, c + 2), dtype, device)
        return p[rng.randint(0, 1) :: rng.randint(1, 3), 1 :: rng.randint(1, 2)]
    if kind == "t":
        return _param(rng, (r, c), dtype, device).t()
    if kind == "nd":
        shape = tuple(rng.randint(1, 6 if small else 12) for _ in range(rng.randint(3, 5)))
        p = _param(rng, shape, dtype, device).permute(*rng.sample(range(len(shape)), len(shape)))
        index = tuple(slice(rng.randint(0, max(0, s - 1) // 2), None) for s in p.shape)
        return p[index]
    if kind == "odd":  # start off any 16-byte boundary
        p = _param(rng, (r * c + 5,), dtype, device)
        a = rng.randint(1, 5)
        return p[a : a + rng.randint(1, r * c)]
    if kind == "scalar":
        return _param(rng, (3,), dtype, device)[1]
    if kind == "empty":
        return _param(rng, (r, c), dtype, device)[:, :0]
    if kind == "8d":
        p = _param(rng, (3,) * 8, dtype, device)
        return p[:, 1:, :2, ::2, 1:, :, 2:, :2]
    # expand: broadcast source (stride 0), only packed
    return _param(rng, (1, c), dtype, device).expand(r, c)


def random_views(
    rng: random.Random, n: int, device: str = "cpu", writable: bool = True
) -> list[torch.Tensor]:
    """``n`` random views; long lists use small shapes to keep CPU time low."""
    return [random_view(rng, device, writable, small=n > 200) for _ in range(n)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The contiguous bytes of ``t`` in row-major element order (an independent packing oracle)."""
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(
        t
    )  # canonical strides, even for size-1 dims
    return dense.reshape(-1).view(torch.uint8)


def poisoned_like(view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A destination view of the same shape/strides/dtype kind in a poisoned parent; (parent bytes, view)."""
    if view.numel() == 0 or view.dim() == 0:
        parent = torch.full(
            (max(1, view.numel()) * view.element_size() + 32,), POISON, dtype=torch.uint8, device=view.device
        )
        dst = parent[16 : 16 + view.numel() * view.element_size()].view(view.dtype).reshape(view.shape)
        return parent, dst
    # Same strides as the source, in a parent buffer with a few poisoned elements around.
    span = 1 + sum((s - 1) * st for s, st in zip(view.shape, view.stride(), strict=True))
    lead = 3
    parent = torch.full(
        ((span + 2 * lead) * view.element_size(),), POISON, dtype=torch.uint8, device=view.device
    )
    base = parent.view(view.dtype) if view.dtype != torch.bool else parent.view(torch.bool)
    dst = base.as_strided(view.shape, view.stride(), lead)
    return parent, dst
