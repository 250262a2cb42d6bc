"""Packed forwards through compiled decoder layers (``algorithm.layers``) equal eager ones.

A compiled layer runs attention and TP collectives eagerly between its compiled pieces; its log-probs
and gradients equal the eager layer's (fp32), with activation recompute too, and a micro-batch of a
new length compiles nothing once the token count is dynamic. On the CPU (inductor's C++ backend) and,
where there is one, on a CUDA GPU (Triton).
"""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.models import ReplicaComm, ShardedCausalLM, pack
from nereus_lightning.models import sharded as sharded_module
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import VOCAB, my_replica, rel_err, tiny_model

#: Packed micro-batches of one training pass: sequence lengths of each.
LENGTHS = ([5, 9, 3], [7, 2, 8, 4], [11, 6], [3, 3, 3, 3, 3])
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _pass(sharded: ShardedCausalLM, lengths: list[int], seed: int) -> tuple[torch.Tensor, dict]:
    """The mean log-partition of one packed micro-batch, and every parameter's gradient of it."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    device = next(sharded.parameters()).device
    packed = pack(ids.to(device), mask.to(device))
    sharded.zero_grad(set_to_none=True)
    hidden = sharded.stage(packed.input_ids, position_ids=packed.position_ids, documents=packed.documents)
    loss = sharded.local_logits(hidden).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in sharded.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_layers_equal_eager_and_compile_once_per_shape_kind(device: str) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("qwen2").to(device)
    runs = {mode: ShardedCausalLM.from_model(model, ReplicaComm.single()) for mode in ("eager", "compiled")}
    for mode, sharded in runs.items():
        sharded.layers = mode
    compiled_after_two = None
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
            if compiled_after_two is None and i == 1:
                compiled_after_two = counters["frames"]["ok"]
    # The layer compiled at the first length and again with a dynamic length at the second; the later
    # lengths and the recomputed passes reuse those graphs.
    assert compiled_after_two is not None and compiled_after_two > 0
    assert counters["frames"]["ok"] == compiled_after_two


def test_auto_compiles_on_cuda_only() -> None:
    sharded = ShardedCausalLM.from_model(tiny_model("qwen2"), ReplicaComm.single())
    assert sharded.layers == "auto"
    assert not sharded._compiles(torch.zeros(1))
    sharded.layers = "compiled"
    assert sharded._compiles(torch.zeros(1))


def _tp_errors(rank: int, world: int) -> dict[str, float]:
    """Compiled against eager packed passes on TP2 x PP2 (the TP collectives between compiled pieces).

    The layer compiles through ``aot_eager`` here: the graph breaks around attention and the
    collectives, and autograd through them, are what this checks; inductor's code is the test above's.
    """
    import functools

    from torch._dynamo.utils import counters

    model = tiny_model("gqa_tied")
    _, comm = my_replica(rank, world, Layout(2, 2), tied=True)
    kept = sharded_module.compiled_layer
    sharded_module.compiled_layer = functools.cache(
        lambda: torch.compile(sharded_module._call_layer, backend="aot_eager")
    )
    errors: dict[str, float] = {}
    try:
        out = {}
        for mode in ("eager", "compiled"):
            sharded = ShardedCausalLM.from_model(model, comm)
            sharded.layers = mode
            hidden_in = None
            lengths = LENGTHS[1]
            gen = torch.Generator().manual_seed(11)
            ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=gen)
            mask = torch.zeros_like(ids)
            for row, n in enumerate(lengths):
                mask[row, :n] = 1
            packed = pack(ids, mask)
            if not comm.is_first_stage:  # a fixed input in place of the previous stage's output
                hidden_in = torch.randn(1, packed.input_ids.shape[1], model.config.hidden_size, generator=gen)
            hidden = sharded.stage(
                packed.input_ids, hidden_in, None, packed.position_ids, documents=packed.documents
            )
            result = sharded.local_logits(hidden) if comm.is_last_stage else hidden
            result.float().square().mean().backward()
            out[mode] = (
                result.detach(),
                {n: p.grad for n, p in sharded.named_parameters() if p.grad is not None},
            )
        (ref, ref_grads), (got, grads) = out["eager"], out["compiled"]
        errors["output"] = rel_err(got, ref)
        errors["grads"] = max(rel_err(g, ref_grads[n]) for n, g in grads.items())
        errors["compiled_frames"] = counters["frames"]["ok"]
    finally:
        sharded_module.compiled_layer = kept
    return errors


def test_compiled_layers_under_tp_and_pp_equal_eager(dist4) -> None:
    for rank, errors in enumerate(dist4.run(_tp_errors)):
        assert errors.pop("compiled_frames") > 0, f"rank {rank}: nothing was compiled"
        assert errors.keys() == {"output", "grads"}
        for key, err in errors.items():
            assert err <= 1e-6, f"rank {rank} {key}: {err:.2e}"
