"""On a CUDA device idle generation and inference units sit in pinned host memory and the step's peak drops.

One rank (NCCL, world size 1), every model-stage on GPU 0: the colocated case, where offloading
each unit right after its use is what lets them share the GPU. Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus_lightning.emu import EMU
from nereus_lightning.lightning import PPOModule
from nereus_lightning.lightning.stages import data_parallel_plan
from nereus_lightning.testing.pool import _free_port
from tests.lightning.helpers import small_task

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRAINS = {"actor_train", "critic_train"}


@pytest.fixture
def nccl():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _steps(steps: int = 2) -> dict:
    """PPO steps on GPU 0; the last step's peaks, each unit's tensors' devices, the logical parameters."""
    torch.manual_seed(0)
    module = PPOModule(task=small_task(), prompts_per_step=8, seed=3)
    module.use_state("emu")
    module.to("cuda")
    opt = module.configure_optimizers()
    plan = data_parallel_plan("ppo", [0])
    for step in range(steps):
        metrics = module.rl_step(step, plan=plan, optimizer=opt)
    units = {stage: module.units._local(stage) for stage in module.units.plan}
    modules = {stage: module.units.get(stage) for stage in module.units.plan}
    torch.cuda.synchronize()
    return {
        "peak": module.peak_memory,
        "metrics": {k: v for k, v in metrics.items() if k.startswith("perf/max_memory_allocated_gb")},
        "residency": module.units.residency(),
        "devices": {s: {t.device.type for _, _, t in u.tensors()} for s, u in units.items()},
        "pinned": {s: all(t.is_pinned() for _, _, t in u.tensors()) for s, u in units.items()},
        "module_devices": {s: {p.device.type for p in m.parameters()} for s, m in modules.items()},
        "params": {
            f"{s}.{n}": p.detach().cpu().clone()
            for s in sorted(TRAINS)
            for n, p in module.units.logical_params(s).items()
        },
    }


def test_offloaded_units_are_in_pinned_host_memory_and_the_peak_is_lower(nccl, monkeypatch):
    offloaded = _steps()
    for stage, resident in offloaded["residency"].items():
        assert resident == (stage in TRAINS), (stage, resident)
        want = {"cuda"} if stage in TRAINS else {"cpu"}
        assert offloaded["devices"][stage] == want, stage
        assert offloaded["module_devices"][stage] == want, stage  # the module's parameters moved with the unit
        if stage not in TRAINS:
            assert offloaded["pinned"][stage], stage
    monkeypatch.setattr(EMU, "offload", lambda self: None)  # every unit stays on the GPU all step
    resident = _steps()
    assert all(resident["residency"].values())
    assert set(offloaded["metrics"]) == set(resident["metrics"]) >= {
        "perf/max_memory_allocated_gb",
        "perf/max_memory_allocated_gb/gen",
        "perf/max_memory_allocated_gb/infer",
        "perf/max_memory_allocated_gb/train",
    }
    assert offloaded["peak"][0] < resident["peak"][0]
    assert offloaded["metrics"]["perf/max_memory_allocated_gb/train"] < resident["metrics"]["perf/max_memory_allocated_gb/train"]
    assert offloaded["params"].keys() == resident["params"].keys()
    for name, value in resident["params"].items():
        assert torch.allclose(offloaded["params"][name], value, atol=1e-6, rtol=0), name
