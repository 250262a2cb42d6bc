"""EMU residency: a unit offloaded without its values (it follows a training stage) is refilled first.

On the CPU host and device are one memory; on a CUDA device the same contract runs across the host link.
"""

from __future__ import annotations

import pytest
import torch

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda:0", marks=[pytest.mark.gpu, GPU])]


def _unit(device: str):  # noqa: ANN202
    from nereus_lightning.emu import EMU
    from nereus_lightning.emu.schema import StateSchema
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.plan.units import Unit
    from tests.emu.workers import tiny

    config, model, _ = tiny("llama", layers=2)
    schema = StateSchema.of(config, model)
    return EMU.from_model("actor_gen", schema, model, Unit(Layout(1, 1), (0,)), 0, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_stale_unit_is_written_by_its_refill_at_onload_and_before_any_read(device):
    emu = _unit(device)
    source = {n: torch.randn_like(t) for n, _, t in emu.tensors()}  # what the training stage holds now
    refills: list[str] = []

    def refill() -> None:
        refills.append("refill")
        with torch.no_grad():
            for n, _, t in emu._all():
                t.copy_(source[n])

    emu.refill = refill
    emu.offload(keep=False)
    assert emu.stale and not emu.resident and refills == []  # nothing copied at the offload
    emu.onload()  # written on the device by the refill, not loaded from the host copies
    assert refills == ["refill"] and emu.resident and not emu.stale
    assert all(t.device == torch.device(device) and torch.equal(t, source[n]) for n, _, t in emu.tensors())

    emu.offload(keep=False)
    source = {n: v + 1.0 for n, v in source.items()}  # the training stage moved on (a new weight sync)
    held = {n: t for n, _, t in emu.tensors()}  # a read of a stale unit: its host copies filled first
    assert refills == ["refill"] * 2 and not emu.stale and not emu.resident
    assert all(t.device.type == "cpu" and torch.equal(t, source[n].cpu()) for n, t in held.items())
    emu.onload()  # from the host copies now (they are current)
    assert refills == ["refill"] * 2
    assert all(torch.equal(t, source[n]) for n, _, t in emu.tensors())


def test_a_stale_unit_without_a_refill_is_refused():
    emu = _unit("cpu")
    emu.offload(keep=False)
    with pytest.raises(RuntimeError, match="without its values"):
        emu.onload()
