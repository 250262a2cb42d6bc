"""Packed forwards through the compiled decoder layers (``algorithm.layers=compiled``) equal eager ones.

Each layer runs through one compiled function around the varlen attention (TP collectives break it
and run eagerly); log-probs and gradients equal the eager layers' (fp32), with activation recompute
too; one compile serves every layer of the stage, and a micro-batch of a new length compiles nothing
(the token count and the longest sequence are dynamic). The varlen kernel is CUDA's and bf16's: the
fp32 tests give the compiled layers a traceable stand-in (sdpa under the packed row's block-diagonal
causal mask) on any device; on a GPU one more test runs the real kernel in bf16.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from nereus_lightning.models import ReplicaComm, ShardedCausalLM, pack
from nereus_lightning.models import packing as packing_module
from nereus_lightning.models import sharded as sharded_module
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import VOCAB, my_replica, rel_err, tiny_model

#: Packed micro-batches of one training pass: sequence lengths of each.
LENGTHS = ([5, 9, 3], [7, 2, 8, 4], [11, 6], [3, 3, 3, 3, 3])


def _masked_varlen(query, key, value, varlen, scaling, window):  # noqa: ANN001, ANN202
    """The varlen kernel's result: sdpa under the block-diagonal causal mask (traceable, any device)."""
    pos = torch.arange(query.shape[2], device=query.device)
    doc = torch.searchsorted(varlen.bounds[1:].long(), pos, right=True)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


@contextmanager
def _varlen_everywhere(backend: str | None = None) -> Iterator[None]:
    """Packed forwards take the compiled path on any device and dtype, on the stand-in kernel."""
    kept = sharded_module.varlen_of, packing_module._varlen, sharded_module.compiled_layer
    sharded_module.varlen_of = lambda docs, device, dtype: packing_module.varlen_args(docs, device)
    packing_module._varlen = _masked_varlen
    if backend is not None:
        sharded_module.compiled_layer = functools.cache(
            lambda: torch.compile(ShardedCausalLM._layer, dynamic=True, backend=backend)
        )
    torch._dynamo.reset()
    try:
        yield
    finally:
        sharded_module.varlen_of, packing_module._varlen, sharded_module.compiled_layer = kept
        torch._dynamo.reset()


def _batch(lengths: list[int], seed: int, device: torch.device | str = "cpu"):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return pack(ids.to(device), mask.to(device))


def _pass(sharded: ShardedCausalLM, lengths: list[int], seed: int) -> tuple[torch.Tensor, dict]:
    """The mean log-partition of one packed micro-batch, and every parameter's gradient of it."""
    packed = _batch(lengths, seed, next(sharded.parameters()).device)
    sharded.zero_grad(set_to_none=True)
    hidden = sharded.stage(packed.input_ids, position_ids=packed.position_ids, documents=packed.documents)
    loss = sharded.local_logits(hidden).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in sharded.named_parameters() if p.grad is not None}


def test_compiled_layers_equal_eager_and_compile_once() -> None:
    from torch._dynamo.utils import counters

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("qwen2").to(device)
    runs = {mode: ShardedCausalLM.from_model(model, ReplicaComm.single()) for mode in ("eager", "compiled")}
    for mode, sharded in runs.items():
        sharded.layers = mode
    with _varlen_everywhere():
        counters.clear()
        compiled_first = None
        for recompute in (False, True):
            for i, lengths in enumerate(LENGTHS):
                out = {}
                for mode, sharded in runs.items():
                    sharded.recompute = recompute
                    out[mode] = _pass(sharded, lengths, i)
                (ref_loss, ref_grads), (loss, grads) = out["eager"], out["compiled"]
                assert rel_err(loss, ref_loss) <= 1e-6, (recompute, lengths)
                assert grads.keys() == ref_grads.keys() and len(grads) > 0
                for name, grad in grads.items():
                    assert rel_err(grad, ref_grads[name]) <= 1e-5, (recompute, lengths, name)
            if compiled_first is None:
                compiled_first = counters["frames"]["ok"]
        # One compile: new lengths reuse its graph; recomputed passes run the layers eagerly.
        assert compiled_first == 1, dict(counters["frames"])
        assert counters["frames"]["ok"] == 1, dict(counters["frames"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_layers_on_the_varlen_kernel_match_eager_in_bf16() -> None:
    from torch._dynamo.utils import counters

    model = tiny_model("qwen2").to("cuda", torch.bfloat16)
    runs = {mode: ShardedCausalLM.from_model(model, ReplicaComm.single()) for mode in ("eager", "compiled")}
    for mode, sharded in runs.items():
        sharded.layers = mode
    torch._dynamo.reset()
    counters.clear()
    for i, lengths in enumerate(LENGTHS):
        (ref_loss, ref_grads), (loss, grads) = (_pass(runs[m], lengths, i) for m in ("eager", "compiled"))
        assert rel_err(loss, ref_loss) <= 1e-2, lengths
        for name, grad in grads.items():
            assert rel_err(grad, ref_grads[name]) <= 5e-2, (lengths, name)
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
    torch._dynamo.reset()


def test_eager_layers_or_no_varlen_kernel_run_as_written() -> None:
    from torch._dynamo.utils import counters

    sharded = ShardedCausalLM.from_model(tiny_model("qwen2"), ReplicaComm.single())
    assert sharded.layers == "compiled"  # the default
    counters.clear()
    _pass(sharded, LENGTHS[0], 0)  # on the CPU: no varlen kernel, so nothing compiles
    with _varlen_everywhere():
        sharded.layers = "eager"
        _pass(sharded, LENGTHS[0], 0)
    assert counters["frames"]["ok"] == 0


def _tp_errors(rank: int, world: int) -> dict[str, float]:
    """Compiled against eager packed passes on TP2 x PP2 (the TP collectives break the compiled graph).

    Through ``aot_eager``: the graph breaks and autograd through them are what this checks; inductor's
    code is the single-process test's.
    """
    from torch._dynamo.utils import counters

    model = tiny_model("gqa_tied")
    _, comm = my_replica(rank, world, Layout(2, 2), tied=True)
    errors: dict[str, float] = {}
    with _varlen_everywhere(backend="aot_eager"):
        counters.clear()
        out = {}
        for mode in ("eager", "compiled"):
            sharded = ShardedCausalLM.from_model(model, comm)
            sharded.layers = mode
            packed = _batch(LENGTHS[1], 11)
            hidden_in = None
            if not comm.is_first_stage:  # a fixed input in place of the previous stage's output
                gen = torch.Generator().manual_seed(12)
                hidden_in = torch.randn(1, packed.input_ids.shape[1], model.config.hidden_size, generator=gen)
            hidden = sharded.stage(
                packed.input_ids, hidden_in, None, packed.position_ids, documents=packed.documents
            )
            result = sharded.local_logits(hidden) if comm.is_last_stage else hidden
            result.float().square().mean().backward()
            grads = {n: p.grad for n, p in sharded.named_parameters() if p.grad is not None}
            out[mode] = (result.detach(), grads)
        (ref, ref_grads), (got, grads) = out["eager"], out["compiled"]
        errors["output"] = rel_err(got, ref)
        errors["grads"] = max(rel_err(g, ref_grads[n]) for n, g in grads.items())
        errors["compiled_frames"] = counters["frames"]["ok"]
    return errors


def test_compiled_layers_under_tp_and_pp_equal_eager(dist4) -> None:
    for rank, errors in enumerate(dist4.run(_tp_errors)):
        assert errors.pop("compiled_frames") > 0, f"rank {rank}: nothing was compiled"
        assert errors.keys() == {"output", "grads"}
        for key, err in errors.items():
            assert err <= 1e-6, f"rank {rank} {key}: {err:.2e}"


def test_an_unknown_layer_mode_is_refused_naming_the_key() -> None:
    from nereus_lightning.lightning.module import check_hyperparameters
    from nereus_lightning.spec.errors import NereusConfigError

    check_hyperparameters({"layers": "compiled"})
    with pytest.raises(NereusConfigError, match="algorithm.layers: 'auto' is not one of 'eager', 'compiled'"):
        check_hyperparameters({"layers": "auto"})
