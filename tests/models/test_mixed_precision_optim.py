"""bind_adamw: AdamW on fp32 masters with fp32 moments, copied into bf16 parameters, in bounded pieces."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nereus_lightning.models import optim
from nereus_lightning.models.optim import BoundedAdamW, adamw_keys, bind_adamw, fresh_adamw_state
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.testing.tiny import VOCAB, tiny_model

HYPER = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


# foreach None on CPU: the per-tensor path; True: the multi-tensor path (the GPU default).
@pytest.mark.parametrize("foreach", [None, True])
def test_bf16_adamw_matches_fp32_adamw_on_the_master(foreach) -> None:
    model = tiny_model("qwen2").to(torch.bfloat16)
    named = dict(model.named_parameters())
    state = {n: fresh_adamw_state(p) for n, p in named.items()}
    storage = {n: p.data_ptr() for n, p in named.items()}
    before = {n: p.detach().clone() for n, p in named.items()}
    opt = bind_adamw(model, state, foreach=foreach, **HYPER)
    assert isinstance(opt, BoundedAdamW)
    # The reference: torch's own AdamW on an fp32 copy, fed the same (upcast) gradients.
    ref = {n: p.detach().float().clone().requires_grad_() for n, p in named.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), foreach=foreach, **HYPER)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
        opt.zero_grad()
        _loss(model, ids).backward()
        for n, p in named.items():
            ref[n].grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for n, p in named.items():
            torch.testing.assert_close(state[n]["master"], ref[n].detach(), msg=f"{n} master, step {step}")
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[n][key].dtype == torch.float32
                torch.testing.assert_close(state[n][key], ref_opt.state[ref[n]][key], msg=f"{n}.{key}")
            assert torch.equal(p.detach(), state[n]["master"].to(torch.bfloat16)), f"{n}: param != master"
            assert float(state[n]["step"]) == step
    for n, p in named.items():
        assert p.dtype == torch.bfloat16 and p.data_ptr() == storage[n], f"{n}: not updated in place"
        assert opt.state[p]["master"] is state[n]["master"], f"{n}: the optimizer does not own the master"
    assert sum(not torch.equal(before[n], p.detach()) for n, p in named.items()) == len(named)


def test_fresh_bf16_adamw_keeps_masters_and_fp32_stays_plain() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    opt = bind_adamw(model, **HYPER)  # no owner: the state is created on the first step
    _loss(model, torch.arange(8)[None]).backward()
    opt.step()
    for p in model.parameters():
        st = opt.state[p]
        assert set(st) == set(adamw_keys(p.dtype)) == {"exp_avg", "exp_avg_sq", "master", "step"}
        assert st["master"].dtype == torch.float32 and torch.equal(p.detach(), st["master"].to(p.dtype))
    fp32 = tiny_model("llama")
    assert not any("master" in s for s in _stepped(fp32, bind_adamw(fp32, **HYPER)).values())
    assert adamw_keys(torch.float32) == ("exp_avg", "exp_avg_sq", "step")


def test_bad_bf16_state_is_refused() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    state = {n: fresh_adamw_state(p) for n, p in model.named_parameters()}
    name = next(iter(state))
    no_master = {**state, name: {k: v for k, v in state[name].items() if k != "master"}}
    with pytest.raises(NereusConfigError, match="master"):
        bind_adamw(model, no_master)
    low_moments = {**state, name: {**state[name], "exp_avg": state[name]["exp_avg"].bfloat16()}}
    with pytest.raises(NereusConfigError, match="float32"):
        bind_adamw(model, low_moments)
    with pytest.raises(NereusConfigError, match="amsgrad"):
        bind_adamw(model, state, amsgrad=True)


def _backward(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    _loss(model, torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))).backward()


def _stepped(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> dict[str, dict]:
    """``steps`` AdamW steps on seeded batches; the optimizer state by parameter name."""
    for step in range(steps):
        _backward(model, opt, step)
        opt.step()
    return {n: opt.state[p] for n, p in model.named_parameters()}


class _LargestFloat(TorchDispatchMode):
    """The most elements of any floating-point tensor an op creates (not an input an in-place op returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs or {}))}
        for t in _tensors(out):
            if t.is_floating_point() and t.dim() > 0 and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("foreach", [None, True])
def test_pieces_change_no_value_and_bound_the_temporaries(monkeypatch, dtype, foreach) -> None:
    whole, cut = tiny_model("qwen2").to(dtype), tiny_model("qwen2").to(dtype)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), cut.parameters(), strict=True))
    largest = max(p.numel() for p in whole.parameters())
    ref = _stepped(whole, bind_adamw(whole, foreach=foreach, **HYPER))
    limit = largest // 3 + 1  # the largest tensors are cut in three pieces; small ones share buckets
    monkeypatch.setattr(optim, "STEP_PIECE_ELEMENTS", limit)
    opt = bind_adamw(cut, foreach=foreach, **HYPER)
    _stepped(cut, opt, steps=1)
    _backward(cut, opt, 1)
    with _LargestFloat() as seen:
        opt.step()
    assert seen.largest <= limit < largest, f"a temporary of {seen.largest} elements (pieces of {limit})"
    for (name, p), q in zip(whole.named_parameters(), cut.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs when stepped in pieces"
        got = opt.state[q]
        assert set(got) == set(ref[name])
        for key, value in ref[name].items():
            assert torch.equal(value, got[key]), f"{name}.{key} differs when stepped in pieces"
        assert float(got["step"]) == 2, f"{name}: a parameter in pieces counts one step"
