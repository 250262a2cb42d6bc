"""Per-row log-softmax statistics and their gradient: the torch reference against float64 oracles,
slices combined as TP ranks will combine them, and the Triton kernels against the reference (under
the Triton interpreter on the CPU, where triton is installed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nereus_lightning.kernels import (
    combine_stats,
    logit_grad,
    logit_grad_reference,
    row_stats,
    row_stats_reference,
)
from tests.kernels.logprobs_cases import (
    GRAD_RTOL,
    autograd_grad,
    direct_stats,
    random_logits,
    random_targets,
    rel_norm,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0, 7), (1, 1), (3, 5), (17, 1000), (9, 4099), (2, 75968)]
REPO = Path(__file__).resolve().parents[2]


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 2e-6, atol: float = 2e-6) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def _splits(V: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) slices of range(V), the last one smaller where V does not divide."""
    step = -(-V // parts)
    bounds = [min(V, k * step) for k in range(parts)] + [V]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


# ---------------------------------------------------------------- the reference vs float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, V", SHAPES)
def test_reference_stats_match_float64(n, V, dtype):
    logits = random_logits(n, V, dtype, seed=n * 31 + V)
    targets = random_targets(n, V, seed=V)
    scale = 0.7 if V % 2 else 1.0
    m, s, e, t = row_stats_reference(logits, targets, scale)
    want = direct_stats(logits, targets, scale)
    for name, got in zip("mset", (m, s, e, t), strict=True):
        assert got.shape == (n,) and got.dtype == torch.float32, name
        _close(got, want[name], rtol=1e-6 if name in "mt" else 2e-6)
    logp, entropy, M, S, mean = combine_stats(m, s, e, t)
    inside = (targets >= 0) & (targets < V)
    # fp32 of values near 10: a few ulp (1e-6 each) of absolute error.
    _close(logp[inside], want["logp"][inside], rtol=1e-6, atol=4e-6)
    _close(entropy, want["entropy"], rtol=1e-6, atol=4e-6)
    _close(mean, want["mean"], rtol=1e-6, atol=4e-6)
    assert torch.equal(M, m) and torch.equal(S, s)


def test_reference_stats_of_large_vocab_have_realistic_logp():
    logits = random_logits(4, 151936, torch.bfloat16, seed=3)
    targets = random_targets(4, 151936, seed=3, outside=0.0)
    logp, entropy, *_ = combine_stats(*row_stats_reference(logits, targets))
    want = direct_stats(logits, targets, 1.0)
    assert bool((logp.abs() > 5).all())  # the regime of the contract (|logp| ~ 12)
    _close(logp, want["logp"], rtol=1e-6, atol=1e-6)
    _close(entropy, want["entropy"], rtol=1e-6, atol=1e-6)


def test_reference_treats_minus_inf_logits_as_absent():
    """Masked vocabulary (-inf) adds nothing: p log p -> 0, no NaN; the same as a very negative logit."""
    logits = random_logits(6, 300, torch.float32, seed=5)
    logits[:, ::7] = float("-inf")
    logits[2, 150:] = float("-inf")
    targets = torch.tensor([7, 1, 100, -3, 300, 299])  # row 0's target logit is -inf: logp = -inf, honestly
    finite = logits.masked_fill(logits.isinf(), -1e4)
    got = row_stats_reference(logits, targets, 0.5)
    want = row_stats_reference(finite, targets, 0.5)
    for a, b in zip(got[:3], want[:3], strict=True):
        assert bool(a.isfinite().all())
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[3][0] == float("-inf") and torch.equal(got[3][1:], want[3][1:])
    _, _, M, S, mean = combine_stats(*got)
    g_logp, g_ent = torch.randn(6), torch.randn(6)
    grad = logit_grad_reference(logits, targets, 0.5, M, S, mean, g_logp, g_ent)
    assert bool(grad.isfinite().all())
    masked = logits.isinf()
    masked[0, 7] = False  # d logp / d x_target = 1 - p: row 0's -inf target still has a gradient
    assert bool((grad[masked] == 0).all())
    rows = torch.arange(6) != 0
    expected = autograd_grad(finite[rows], targets[rows], 0.5, g_logp[rows], g_ent[rows])
    assert rel_norm(grad[rows], expected) < GRAD_RTOL[torch.float32]


# ---------------------------------------------------------------- slices combined (TP ranks)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, V", [(0, 9), (5, 7), (13, 1001), (3, 75968)])
def test_combined_slices_equal_the_whole_vocabulary(n, V, dtype, parts):
    logits = random_logits(n, V, dtype, seed=V + parts)
    targets = random_targets(n, V, seed=n + parts, outside=0.2)  # global ids; some in no slice
    scale = 1.3
    sliced = [row_stats_reference(logits[:, a:b], targets - a, scale) for a, b in _splits(V, parts)]
    stacked = [torch.stack(column) for column in zip(*sliced, strict=True)]
    assert stacked[0].shape == (parts, n)
    logp, entropy, M, S, mean = combine_stats(*stacked)
    whole = combine_stats(*row_stats_reference(logits, targets, scale))
    want = direct_stats(logits, targets, scale)
    inside = (targets >= 0) & (targets < V)
    _close(M, whole[2], rtol=0, atol=0)
    pairs = ((logp, whole[0], "logp"), (entropy, whole[1], "entropy"), (mean, whole[4], "mean"))
    for got, ref, name in pairs:
        rows = inside if name == "logp" else slice(None)
        _close(got[rows], ref[rows], rtol=1e-6, atol=4e-6)
        _close(got[rows], want[name][rows], rtol=1e-6, atol=4e-6)
    _close(S, whole[3], rtol=2e-6, atol=0)


# ---------------------------------------------------------------- the gradient vs float64 autograd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, V", [(0, 7), (1, 1), (6, 5), (11, 1000), (5, 4099)])
@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
def test_reference_grad_matches_float64_autograd(n, V, dtype, which):
    logits = random_logits(n, V, dtype, seed=V * 3 + n)
    targets = random_targets(n, V, seed=V)
    scale = 0.8
    _, _, M, S, mean = combine_stats(*row_stats_reference(logits, targets, scale))
    gen = torch.Generator().manual_seed(n)
    g_logp = None if which == "entropy" else torch.randn(n, generator=gen)
    g_ent = None if which == "logp" else torch.randn(n, generator=gen)
    grad = logit_grad_reference(logits, targets, scale, M, S, mean, g_logp, g_ent)
    assert grad.shape == (n, V) and grad.dtype == dtype and grad.is_contiguous()
    assert rel_norm(grad, autograd_grad(logits, targets, scale, g_logp, g_ent)) < GRAD_RTOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_grads_concatenate_to_the_whole_vocabulary_grad(dtype):
    n, V = 9, 3001
    logits = random_logits(n, V, dtype, seed=11)
    targets = random_targets(n, V, seed=11, outside=0.0)
    scale = 1.1
    gen = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    slices = _splits(V, 3)
    stats = [row_stats_reference(logits[:, a:b], targets - a, scale) for a, b in slices]
    _, _, M, S, mean = combine_stats(*(torch.stack(c) for c in zip(*stats, strict=True)))
    grads = [
        logit_grad_reference(logits[:, a:b], targets - a, scale, M, S, mean, g_logp, g_ent) for a, b in slices
    ]
    expected = autograd_grad(logits, targets, scale, g_logp, g_ent)
    assert rel_norm(torch.cat(grads, dim=1), expected) < GRAD_RTOL[dtype]


def test_no_upstream_gradient_gives_zeros():
    logits = random_logits(4, 10, torch.bfloat16, seed=0)
    ones = torch.ones(4)
    grad = logit_grad(logits, torch.arange(4), 1.0, ones, ones, ones, None, None)
    assert grad.dtype == torch.bfloat16 and not grad.any()


# ---------------------------------------------------------------- dispatch and argument checks


def test_cpu_dispatch_is_the_reference():
    logits = random_logits(7, 333, torch.bfloat16, seed=2)
    targets = random_targets(7, 333, seed=2)
    got, want = row_stats(logits, targets, 0.9), row_stats_reference(logits, targets, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    _, _, M, S, mean = combine_stats(*want)
    g = torch.randn(7)
    assert torch.equal(
        logit_grad(logits, targets, 0.9, M, S, mean, g, g),
        logit_grad_reference(logits, targets, 0.9, M, S, mean, g, g),
    )


def test_row_slices_of_a_wider_tensor_are_accepted():
    wide = random_logits(5, 120, torch.float32, seed=4)
    view = wide[:, 10:110]  # row stride 120, last dim contiguous
    targets = random_targets(5, 100, seed=4)
    got = row_stats_reference(view, targets)
    want = row_stats_reference(view.contiguous(), targets)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "logits, targets",
    [
        (torch.randn(3, 4, 5), torch.zeros(3, dtype=torch.long)),  # not 2-D
        (torch.randn(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.long)),  # dtype
        (torch.randn(3, 0), torch.zeros(3, dtype=torch.long)),  # empty slice
        (torch.randn(4, 3).t(), torch.zeros(3, dtype=torch.long)),  # last dim strided
        (torch.randn(3, 4), torch.zeros(3)),  # float targets
        (torch.randn(3, 4), torch.zeros(2, dtype=torch.long)),  # wrong length
    ],
)
def test_bad_arguments_are_refused(logits, targets):
    with pytest.raises(ValueError):
        row_stats(logits, targets)


def test_bad_row_vectors_are_refused():
    logits, targets = torch.randn(3, 4), torch.zeros(3, dtype=torch.long)
    good = torch.ones(3)
    with pytest.raises(ValueError, match="g_ent"):
        logit_grad(logits, targets, 1.0, good, good, good, good, torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="S"):
        logit_grad(logits, targets, 1.0, good, torch.ones(4), good, good, None)


# ---------------------------------------------------------------- Triton kernels (interpreter)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (optional); its interpreter checks the kernels only where it is",
)
def test_triton_kernels_match_the_reference_under_the_interpreter():
    """TRITON_INTERPRET is read when a kernel is decorated, so the check runs in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.logprobs_interpret"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "all interpreter checks passed" in run.stdout
