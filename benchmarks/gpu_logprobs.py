"""Triton log-prob kernels (``kernels/softmax_stats``) on one GPU: checked against the reference, then timed.

Checks (fresh random inputs each, outputs poisoned with NaN before every launch): bf16 and fp32
logits, n in {1, 777, 4096} rows, V in {151936, 75968, 32000} (Qwen2's vocabulary at TP1 / TP2,
Llama-2's; the 32000 case is a column slice of a wider tensor, so its row stride is not V), about a
quarter of the targets outside the slice, scale 1/0.7:

- forward: m and t bit for bit; s and e within rtol 1e-5; logp (rows with a target inside),
  entropy and mean, combined by ``combine_stats``, within rtol 1e-6 + atol 1e-6;
- backward: relative norm to the reference grad <= 1e-5 (fp32) / 1e-2 (bf16), every element
  written and finite; both upstream gradients, and (777 x 75968) each alone;
- int64 offsets: n x V > 2**31 elements (bf16, V = 151936), first and last rows against the reference.

Timing (``triton.testing.do_bench``, median; n = 4096, V = 151936, bf16): reference and Triton,
forward (``row_stats``) and backward (``logit_grad``), with the achieved GB/s of the fewest bytes
(forward: one read of n*V*2 bytes; backward: one read and one write), a device-to-device copy as the
bandwidth ceiling, and each version's peak extra memory in fp32 copies of the chunk (n*V*4 bytes).
``--sweep`` also times the Triton kernels over BLOCK_V x num_warps.

    python benchmarks/gpu_logprobs.py [--sweep] [--out $OUT/gpu_logprobs.json]
    python benchmarks/gpu_logprobs.py --smoke    # CPU, small shapes, the Triton interpreter: checks only

Exits 1 if any check fails (timing is skipped then), 2 without a CUDA GPU or triton.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECK_ROWS = (1, 777, 4096)
CHECK_VOCABS = (151936, 75968, 32000)  # the last one is a column slice of a wider tensor
GRAD_ALONE = (777, 75968)  # the case that also checks each upstream gradient alone
DEVICE = "cuda"
CHECK_BLOCK: dict[str, int] = {}  # the smoke run's small BLOCK_V (several blocks a row); else the default
SCALE = 1 / 0.7
SWEEP = (
    (2048, 4),
    (2048, 8),
    (4096, 4),
    (4096, 8),
    (4096, 16),
    (8192, 8),
    (8192, 16),
    (16384, 16),
    (16384, 32),
)
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(n: int, V: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits (std 4: |logp| near 12 at V = 151936) and targets, a quarter outside [0, V)."""
    width = V + 64 if V == CHECK_VOCABS[-1] else V  # one case with a row stride != V
    logits = (torch.randn(n, width, device=DEVICE, generator=gen) * 4).to(dtype)[:, :V]
    targets = torch.randint(0, V, (n,), device=DEVICE, generator=gen)
    away = torch.rand(n, device=DEVICE, generator=gen) < 0.25
    shift = torch.where(torch.rand(n, device=DEVICE, generator=gen) < 0.5, -V - 3, V)
    return logits, torch.where(away, targets + shift, targets)


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _max_err(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> float:
    """Largest |a - b| / (atol + rtol |b|): <= 1 passes; inf where a is not finite."""
    if a.numel() == 0:
        return 0.0
    if not bool(a.isfinite().all()):
        return float("inf")
    return ((a.double() - b.double()).abs() / (atol + rtol * b.double().abs())).max().item()


def check_stats(tk: Any, logits: torch.Tensor, targets: torch.Tensor, scale: float) -> list[str]:
    """Forward kernel vs reference; returns the failures."""
    from nereus_lightning.kernels import combine_stats, row_stats_reference

    n, V = logits.shape
    out = tuple(torch.full((n,), float("nan"), device=DEVICE) for _ in range(4))
    got = tk.row_stats(logits, targets, scale, out=out, **CHECK_BLOCK)
    want = row_stats_reference(logits, targets, scale)
    errors = [
        f"{k} not bit-equal"
        for k, a, b in zip("mt", got[::3], want[::3], strict=True)
        if not torch.equal(a, b)
    ]
    errors += [
        f"{k} err {err:.3g}"
        for k, a, b in zip("se", got[1:3], want[1:3], strict=True)
        if (err := _max_err(a, b, 1e-5, 0.0)) > 1
    ]
    inside = (targets >= 0) & (targets < V)
    g_logp, g_ent, _, _, g_mean = combine_stats(*got)
    w_logp, w_ent, _, _, w_mean = combine_stats(*want)
    for name, a, b in (
        ("logp", g_logp[inside], w_logp[inside]),
        ("entropy", g_ent, w_ent),
        ("mean", g_mean, w_mean),
    ):
        if (err := _max_err(a, b, 1e-6, 1e-6)) > 1:
            errors.append(f"{name} err {err:.3g} (max |diff| {(a - b).abs().max().item():.3g})")
    return errors


def check_grads(tk: Any, logits: torch.Tensor, targets: torch.Tensor, scale: float, alone: bool) -> list[str]:
    """Backward kernel vs reference (both upstream gradients; each alone too if ``alone``)."""
    from nereus_lightning.kernels import combine_stats, logit_grad_reference, row_stats_reference

    n = logits.shape[0]
    _, _, M, S, mean = combine_stats(*row_stats_reference(logits, targets, scale))
    g_logp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    variants = [(g_logp, g_ent)] + ([(g_logp, None), (None, g_ent)] if alone else [])
    errors = []
    for gl, ge in variants:
        out = torch.full(logits.shape, float("nan"), dtype=logits.dtype, device=DEVICE)
        got = tk.logit_grad(logits, targets, scale, M, S, mean, gl, ge, out=out, **CHECK_BLOCK)
        want = logit_grad_reference(logits, targets, scale, M, S, mean, gl, ge)
        label = f"grad(logp={gl is not None}, ent={ge is not None})"
        if not bool(got.isfinite().all()):
            errors.append(f"{label}: unwritten or non-finite elements")
        elif (rel := _rel_norm(got, want)) > GRAD_RTOL[logits.dtype]:
            errors.append(f"{label}: relative norm {rel:.3g}")
    return errors


def check_int64_offsets(tk: Any, gen: torch.Generator) -> list[str]:
    """n * V > 2**31 elements: the first and last rows of a bf16 chunk against the reference."""
    V = 151936
    n = 2**31 // V + 64
    logits = torch.randn(n, V, device=DEVICE, dtype=torch.bfloat16, generator=gen).mul_(4)
    targets = torch.randint(0, V, (n,), device=DEVICE, generator=gen)
    rows = torch.cat([torch.arange(4), torch.arange(n - 4, n)]).to(DEVICE)
    errors = []
    m, s, e, t = tk.row_stats(logits, targets, 1.0)
    stats = [v[rows] for v in (m, s, e, t)]
    errors += [f"int64 stats: {x}" for x in _compare_rows(stats, logits[rows], targets[rows])]
    from nereus_lightning.kernels import combine_stats, logit_grad_reference

    _, _, M, S, mean = combine_stats(m, s, e, t)
    g = torch.randn(n, device=DEVICE)
    grad = tk.logit_grad(logits, targets, 1.0, M, S, mean, g, g)
    want = logit_grad_reference(
        logits[rows], targets[rows], 1.0, M[rows], S[rows], mean[rows], g[rows], g[rows]
    )
    if (rel := _rel_norm(grad[rows], want)) > GRAD_RTOL[torch.bfloat16]:
        errors.append(f"int64 grad: relative norm {rel:.3g}")
    return errors


def _compare_rows(stats: list[torch.Tensor], logits: torch.Tensor, targets: torch.Tensor) -> list[str]:
    from nereus_lightning.kernels import row_stats_reference

    want = row_stats_reference(logits, targets, 1.0)
    return [
        f"{k} err {err:.3g}"
        for k, a, b in zip("mset", stats, want, strict=True)
        if (err := _max_err(a, b, 1e-5, 0)) > 1
    ]


def run_checks(tk: Any) -> int:
    """Every check; prints one line per case and returns the number of failures."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    failures = 0
    for dtype in (torch.bfloat16, torch.float32):
        for n in CHECK_ROWS:
            for V in CHECK_VOCABS:
                logits, targets = _inputs(n, V, dtype, gen)
                errors = check_stats(tk, logits, targets, SCALE)
                errors += check_grads(tk, logits, targets, SCALE, alone=(n, V) == GRAD_ALONE)
                failures += len(errors)
                status = "ok" if not errors else "FAIL " + "; ".join(errors)
                print(f"check {str(dtype)[6:]:>8} n={n:<5} V={V:<6} {status}")
                del logits, targets
    if DEVICE == "cuda":  # 4.3 GB of logits: not for the CPU smoke run
        errors = check_int64_offsets(tk, gen)
        failures += len(errors)
        print(f"check int64 offsets (n*V > 2**31) {'ok' if not errors else 'FAIL ' + '; '.join(errors)}")
        torch.cuda.empty_cache()
    return failures


def _peak_extra(fn: Callable[[], object]) -> int:
    """Bytes allocated by one call beyond what was allocated before it (its result included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (CUDA events; warm-up first)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _copy_ceiling(like: torch.Tensor) -> float:
    """GB/s of a device-to-device copy of ``like`` (bytes read + written): the bandwidth ceiling."""
    dst = torch.empty_like(like)
    ms = _bench(lambda: dst.copy_(like))
    return 2 * like.numel() * like.element_size() / ms / 1e6


def run_timing(sweep: bool, n: int = 4096, V: int = 151936) -> dict[str, Any]:
    """Time reference vs Triton (forward, backward) on bf16 [n, V] logits; print a table."""
    from nereus_lightning.kernels import _softmax_stats_triton as tk
    from nereus_lightning.kernels import (
        combine_stats,
        logit_grad,
        logit_grad_reference,
        row_stats,
        row_stats_reference,
    )

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    logits = (torch.randn(n, V, device=DEVICE, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, V, (n,), device=DEVICE, generator=gen)
    ref_logp, ref_ent, M, S, mean = combine_stats(*row_stats_reference(logits, targets))
    g_logp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    nbytes = logits.numel() * logits.element_size()
    fp32_chunk = logits.numel() * 4
    ceiling = _copy_ceiling(logits)
    rows = []
    cases = [
        ("forward", "reference", lambda: row_stats_reference(logits, targets), nbytes),
        ("forward", "triton", lambda: row_stats(logits, targets), nbytes),
        (
            "backward",
            "reference",
            lambda: logit_grad_reference(logits, targets, 1.0, M, S, mean, g_logp, g_ent),
            2 * nbytes,
        ),
        (
            "backward",
            "triton",
            lambda: logit_grad(logits, targets, 1.0, M, S, mean, g_logp, g_ent),
            2 * nbytes,
        ),
    ]
    for op, impl, fn, moved in cases:
        ms = _bench(fn)
        peak = _peak_extra(fn)
        rows.append(
            dict(
                op=op,
                impl=impl,
                ms=ms,
                gbps=moved / ms / 1e6,
                floor_ms=moved / ceiling / 1e6,
                peak_fp32_copies=peak / fp32_chunk,
            )
        )
    sweep_rows = []
    if sweep:
        default_warps = tk.NUM_WARPS
        ref_grad = logit_grad_reference(logits, targets, 1.0, M, S, mean, g_logp, g_ent)
        for block_v, warps in SWEEP:
            tk.NUM_WARPS = warps
            fwd = _bench(lambda b=block_v: tk.row_stats(logits, targets, 1.0, block_v=b))
            bwd = _bench(
                lambda b=block_v: tk.logit_grad(logits, targets, 1.0, M, S, mean, g_logp, g_ent, block_v=b)
            )
            logp, ent, *_ = combine_stats(*tk.row_stats(logits, targets, 1.0, block_v=block_v))
            grad = tk.logit_grad(logits, targets, 1.0, M, S, mean, g_logp, g_ent, block_v=block_v)
            ok = max(_max_err(logp, ref_logp, 1e-6, 1e-6), _max_err(ent, ref_ent, 1e-6, 1e-6)) <= 1
            ok = ok and _rel_norm(grad, ref_grad) <= GRAD_RTOL[torch.bfloat16]
            del grad
            sweep_rows.append(
                dict(
                    ok=ok,
                    block_v=block_v,
                    num_warps=warps,
                    fwd_ms=fwd,
                    bwd_ms=bwd,
                    fwd_gbps=nbytes / fwd / 1e6,
                    bwd_gbps=2 * nbytes / bwd / 1e6,
                )
            )
        tk.NUM_WARPS = default_warps
    _print_table(n, V, ceiling, rows, sweep_rows, tk)
    return dict(n=n, V=V, dtype="bf16", copy_ceiling_gbps=ceiling, rows=rows, sweep=sweep_rows)


def _print_table(n: int, V: int, ceiling: float, rows: list[dict], sweep_rows: list[dict], tk: Any) -> None:
    print(
        f"\nn={n} V={V} bf16; copy ceiling {ceiling:.0f} GB/s (read + write); "
        f"BLOCK_V={tk.BLOCK_V} num_warps={tk.NUM_WARPS}"
    )
    print(
        f"{'op':<9}{'impl':<10}{'median ms':>10}{'GB/s':>8}{'floor ms':>10}{'x floor':>9}"
        f"{'peak (fp32 copies)':>20}"
    )
    for r in rows:
        print(
            f"{r['op']:<9}{r['impl']:<10}{r['ms']:>10.3f}{r['gbps']:>8.0f}{r['floor_ms']:>10.3f}"
            f"{r['ms'] / r['floor_ms']:>9.2f}{r['peak_fp32_copies']:>20.2f}"
        )
    if sweep_rows:
        print(
            f"\n{'BLOCK_V':>8}{'warps':>6}{'fwd ms':>9}{'fwd GB/s':>10}{'bwd ms':>9}{'bwd GB/s':>10}  check"
        )
        for r in sweep_rows:
            print(
                f"{r['block_v']:>8}{r['num_warps']:>6}{r['fwd_ms']:>9.3f}{r['fwd_gbps']:>10.0f}"
                f"{r['bwd_ms']:>9.3f}{r['bwd_gbps']:>10.0f}  {'ok' if r['ok'] else 'FAIL'}"
            )


def _smoke_setup() -> None:
    """Small shapes, CPU tensors, the Triton interpreter (set before triton decorates the kernels)."""
    global DEVICE, CHECK_ROWS, CHECK_VOCABS, GRAD_ALONE
    os.environ["TRITON_INTERPRET"] = "1"
    DEVICE, CHECK_ROWS, CHECK_VOCABS, GRAD_ALONE = "cpu", (1, 5), (300, 4099, 64), (5, 300)
    CHECK_BLOCK["block_v"] = 128


def main(argv: list[str] | None = None) -> int:
    """Checks, then timing; the exit status says whether every check passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time BLOCK_V x num_warps variants")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    parser.add_argument("--smoke", action="store_true", help="CPU: the checks on small shapes, interpreted")
    args = parser.parse_args(argv)
    if args.smoke:
        _smoke_setup()
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    try:
        import triton
    except ImportError:
        print("needs triton")
        return 2
    from nereus_lightning.kernels import _softmax_stats_triton as tk

    where = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}; triton {triton.__version__}")
    failures = run_checks(tk)
    if failures:
        print(f"{failures} checks FAILED; no timing")
        return 1
    if args.smoke:
        print("all checks passed (smoke run: no timing)")
        return 0
    result = run_timing(args.sweep)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if not all(r["ok"] for r in result["sweep"]):
        print("a sweep variant FAILED its check")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
