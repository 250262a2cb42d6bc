"""Triton kernels for :mod:`nereus_lightning.kernels.softmax_stats` (imported only where triton is).

One program per row loops over the row's vocabulary slice in blocks of ``BLOCK_V``: the forward
reads each logit once and writes four floats per row; the backward reads each logit once and
writes its gradient once. Nothing of size [n, V] is allocated besides the gradient itself.
Row offsets are int64 (n * V may exceed 2**31). Arguments are checked by the caller.
"""

# No ``from __future__ import annotations``: triton reads the ``tl.constexpr`` annotations as objects.

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 4096  # logits per loop step of one program; to be tuned on the GPU
NUM_WARPS = 8


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    targets_ptr,
    m_ptr,
    s_ptr,
    e_ptr,
    t_ptr,
    V,
    stride_row,
    scale,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    e = 0.0
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        mask = idx < V
        x = tl.load(row_ptr + idx, mask=mask, other=0.0).to(tl.float32) * scale
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A row that is -inf so far keeps a finite shift, so no inf - inf appears below.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        # s > 0 exactly when m is finite; guarding the shift avoids -inf * 0 on the first block.
        shift = tl.where(s > 0.0, m - m_ref, 0.0)
        a = tl.exp(shift)
        d = x - m_ref
        p = tl.exp(d)
        # Every term of e is <= 0 (d <= 0, shift <= 0): the rescaled sum has no cancellation.
        # p == 0 (a -inf logit, a masked lane, an underflow) contributes 0, not 0 * -inf.
        e = a * (e + shift * s) + tl.sum(tl.where(p > 0.0, p * d, 0.0), axis=0)
        s = a * s + tl.sum(p, axis=0)
        m = m_new
    tgt = tl.load(targets_ptr + row)
    inside = (tgt >= 0) & (tgt < V)
    xt = tl.load(row_ptr + tgt, mask=inside, other=0.0).to(tl.float32) * scale
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(e_ptr + row, e)
    tl.store(t_ptr + row, tl.where(inside, xt, 0.0))


@triton.jit
def _logit_grad_kernel(
    logits_ptr,
    grad_ptr,
    targets_ptr,
    M_ptr,
    S_ptr,
    mean_ptr,
    g_logp_ptr,
    g_ent_ptr,
    V,
    stride_row,
    stride_grad,
    scale,
    HAS_LOGP: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    grad_row = grad_ptr + row * stride_grad
    cols = tl.arange(0, BLOCK_V)
    M = tl.load(M_ptr + row)
    inv_S = 1.0 / tl.load(S_ptr + row)
    mean = tl.load(mean_ptr + row)
    tgt = tl.load(targets_ptr + row)
    # int32 for the per-element compare; a target outside [0, V) becomes -1 and matches no column.
    tgt = tl.where((tgt >= 0) & (tgt < V), tgt, -1).to(tl.int32)
    g_logp = 0.0
    g_ent = 0.0
    if HAS_LOGP:
        g_logp = tl.load(g_logp_ptr + row)
    if HAS_ENT:
        g_ent = tl.load(g_ent_ptr + row)
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        mask = idx < V
        x = tl.load(row_ptr + idx, mask=mask, other=0.0).to(tl.float32) * scale
        p = tl.exp(x - M) * inv_S
        g = tl.zeros([BLOCK_V], dtype=tl.float32)
        if HAS_LOGP:
            # A target outside this slice has its one-hot on another rank.
            g = g_logp * (tl.where(idx == tgt, 1.0, 0.0) - p)
        if HAS_ENT:
            g = g - g_ent * tl.where(p > 0.0, p * (x - mean), 0.0)
        tl.store(grad_row + idx, (g * scale).to(grad_ptr.dtype.element_ty), mask=mask)


def row_stats(
    logits: Tensor,
    targets: Tensor,
    scale: float,
    out: tuple[Tensor, ...] | None = None,
    block_v: int = BLOCK_V,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the forward kernel; ``out`` (four fp32 [n]) lets a check poison the outputs first."""
    n, V = logits.shape
    if out is None:
        out = tuple(torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
    m, s, e, t = out
    if n:
        _row_stats_kernel[(n,)](
            logits,
            targets,
            m,
            s,
            e,
            t,
            V,
            logits.stride(0),
            float(scale),
            BLOCK_V=block_v,
            num_warps=NUM_WARPS,
        )
    return m, s, e, t


def logit_grad(
    logits: Tensor,
    targets: Tensor,
    scale: float,
    M: Tensor,
    S: Tensor,
    mean: Tensor,
    g_logp: Tensor | None,
    g_ent: Tensor | None,
    out: Tensor | None = None,
    block_v: int = BLOCK_V,
) -> Tensor:
    """Launch the backward kernel; ``out`` ([n, V], logits' dtype, last dim contiguous) may be poisoned."""
    n, V = logits.shape
    if out is None:
        out = torch.empty((n, V), dtype=logits.dtype, device=logits.device)
    # The kernel reads element ``row`` of each [n] vector: a strided view (a column of a stack) is copied.
    M, S, mean = M.contiguous(), S.contiguous(), mean.contiguous()
    g_logp = None if g_logp is None else g_logp.contiguous()
    g_ent = None if g_ent is None else g_ent.contiguous()
    if n:
        _logit_grad_kernel[(n,)](
            logits,
            out,
            targets,
            M,
            S,
            mean,
            M if g_logp is None else g_logp,  # never read when the flag is off
            M if g_ent is None else g_ent,
            V,
            logits.stride(0),
            out.stride(0),
            float(scale),
            HAS_LOGP=g_logp is not None,
            HAS_ENT=g_ent is not None,
            BLOCK_V=block_v,
            num_warps=NUM_WARPS,
        )
    return out
