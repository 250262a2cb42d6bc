"""The Triton log-prob kernels against the torch reference under the Triton interpreter (CPU tensors).

Run in a process of its own with ``TRITON_INTERPRET=1`` (set before triton decorates the kernels):
``TRITON_INTERPRET=1 python -m tests.kernels.logprobs_interpret``; exits non-zero on a failure.
Small blocks (``block_v`` 64 / 128) make every row take several loop steps, so the online rescaling
and the ragged last block are exercised. Outputs are poisoned (NaN) before each launch.

The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), so a bf16 gradient
is checked by relative norm only; fp32 and fp16 gradients and all statistics are compared closely.
"""

from __future__ import annotations

import os
import sys

import torch

from nereus_lightning.kernels import _softmax_stats_triton as triton_kernels
from nereus_lightning.kernels import combine_stats, logit_grad_reference, row_stats_reference
from tests.kernels.logprobs_cases import random_logits, random_targets, rel_norm

CASES = [  # n, V, block_v, scale
    (0, 5, 64, 1.0),
    (1, 1, 64, 1.0),
    (3, 7, 64, 0.7),
    (6, 300, 64, 1.0),
    (4, 1000, 128, 1.3),
    (2, 128, 128, 1.0),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp32: the same operations in the same order, so far inside the contract's 1e-5.
GRAD_RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _inputs(n: int, V: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits as columns of a wider tensor (row stride != V), some -inf, and mixed targets."""
    wide = random_logits(n, V + 11, dtype, seed=seed)
    logits = wide[:, 5 : 5 + V]
    if V > 10:
        logits[:, 3::17] = float("-inf")
    return logits, random_targets(n, V, seed=seed)


def _check_stats(logits: torch.Tensor, targets: torch.Tensor, scale: float, block_v: int) -> list[str]:
    n = logits.shape[0]
    out = tuple(torch.full((n,), float("nan")) for _ in range(4))
    got = triton_kernels.row_stats(logits, targets, scale, out=out, block_v=block_v)
    want = row_stats_reference(logits, targets, scale)
    errors = []
    for name, a, b in zip("mset", got, want, strict=True):
        if name in "mt" and not torch.equal(a, b):
            errors.append(f"{name} differs: {a} vs {b}")
        elif not torch.allclose(a, b, rtol=1e-6, atol=1e-6):
            errors.append(f"{name} beyond 1e-6: max diff {(a - b).abs().max().item():.3g}")
    inside = (targets >= 0) & (targets < logits.shape[1])
    combined = zip(("logp", "entropy"), combine_stats(*got)[:2], combine_stats(*want)[:2], strict=True)
    for name, a, b in combined:
        rows = inside if name == "logp" else slice(None)
        if not torch.allclose(a[rows], b[rows], rtol=1e-6, atol=1e-6):
            errors.append(f"{name} beyond 1e-6: max diff {(a[rows] - b[rows]).abs().max().item():.3g}")
    return errors


def _check_grads(logits: torch.Tensor, targets: torch.Tensor, scale: float, block_v: int) -> list[str]:
    n = logits.shape[0]
    _, _, M, S, mean = combine_stats(*row_stats_reference(logits, targets, scale))
    gen = torch.Generator().manual_seed(n)
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    # Row vectors as strided views (columns of a stack), as an all-reduced buffer may hand them over.
    M, S, mean = torch.stack([M, S, mean, M], dim=1).unbind(1)[:3]
    errors = []
    for gl, ge in ((g_logp, g_ent), (g_logp, None), (None, g_ent)):
        out = torch.full(logits.shape, float("nan"), dtype=logits.dtype)
        got = triton_kernels.logit_grad(logits, targets, scale, M, S, mean, gl, ge, out=out, block_v=block_v)
        want = logit_grad_reference(logits, targets, scale, M, S, mean, gl, ge)
        label = f"grad(logp={gl is not None}, ent={ge is not None})"
        if not bool(got.isfinite().all()):
            errors.append(f"{label}: unwritten or non-finite elements")
        elif rel_norm(got, want) > GRAD_RTOL[logits.dtype]:
            errors.append(f"{label}: relative norm {rel_norm(got, want):.3g}")
    return errors


def main() -> int:
    """Every case and dtype; prints one line per failure and a summary."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: these checks run the kernels on CPU tensors")
        return 2
    failures = 0
    for seed, (n, V, block_v, scale) in enumerate(CASES):
        for dtype in DTYPES:
            logits, targets = _inputs(n, V, dtype, seed)
            for error in _check_stats(logits, targets, scale, block_v) + _check_grads(
                logits, targets, scale, block_v
            ):
                failures += 1
                print(f"FAIL n={n} V={V} block={block_v} {dtype}: {error}")
    if failures:
        print(f"{failures} interpreter checks failed")
        return 1
    print(f"all interpreter checks passed ({len(CASES) * len(DTYPES)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
