"""On a CUDA device idle generation and inference units sit in pinned host memory and the step's peak drops.

One rank (NCCL, world size 1) in a spawned process per run, every model-stage on GPU 0: the
colocated case, where offloading each unit right after its use is what lets them share the GPU.
Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRAINS = {"actor_train", "critic_train"}


def _steps_worker(port: int, offload: bool, queue, steps: int = 2) -> None:  # noqa: ANN001
    """PPO steps on GPU 0; puts the last step's peaks, each unit's tensors' devices and the logical
    parameters.
    """
    import torch.distributed as dist

    from nereus_lightning.control import data_parallel_plan
    from nereus_lightning.emu import EMU
    from nereus_lightning.lightning import NereusStrategy, PPOModule
    from tests.lightning.helpers import small_task

    if not offload:
        EMU.offload = lambda self, keep=True: None  # every unit stays on the GPU all step
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device
    )
    try:
        torch.manual_seed(0)
        module = PPOModule(task=small_task(), prompts_per_step=8, seed=3)
        module.to(device)
        opt = module.configure_optimizers()
        strategy = NereusStrategy.without_trainer(module)
        strategy.transition(data_parallel_plan("ppo", [0]))
        for step in range(steps):
            metrics = module.rl_step(step, strategy, opt)
        held = strategy.units
        units = {stage: held._local(stage) for stage in held.plan}
        modules = {stage: held.stage(stage) for stage in held.plan}
        torch.cuda.synchronize()
        queue.put(
            {
                "metrics": {k: v for k, v in metrics.items() if k.startswith("perf/max_memory_allocated_gb")},
                "residency": held.residency(),
                "devices": {s: {t.device.type for _, _, t in u.tensors()} for s, u in units.items()},
                "pinned": {s: all(t.is_pinned() for _, _, t in u.tensors()) for s, u in units.items()},
                "module_devices": {s: {p.device.type for p in m.parameters()} for s, m in modules.items()},
                "params": {
                    f"{s}.{n}": p.detach().cpu().clone()
                    for s in sorted(TRAINS)
                    for n, p in held.logical_params(s).items()
                },
            }
        )
    finally:
        dist.destroy_process_group()


def _run(offload: bool) -> dict:
    import torch.multiprocessing as mp

    from nereus_lightning.testing.pool import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_steps_worker, args=(free_port(), offload, queue))
    proc.start()
    out = queue.get(timeout=600)
    proc.join(timeout=60)
    assert proc.exitcode == 0, proc.exitcode
    return out


def test_offloaded_units_are_in_pinned_host_memory_and_the_peak_is_lower():
    offloaded = _run(offload=True)
    for stage, resident in offloaded["residency"].items():
        assert resident == (stage in TRAINS), (stage, resident)
        want = {"cuda"} if stage in TRAINS else {"cpu"}
        assert offloaded["devices"][stage] == want, stage
        assert offloaded["module_devices"][stage] == want, (
            stage
        )  # the module's parameters moved with the unit
        if stage not in TRAINS:
            assert offloaded["pinned"][stage], stage
    resident = _run(offload=False)
    assert all(resident["residency"].values())
    assert (
        set(offloaded["metrics"])
        == set(resident["metrics"])
        >= {
            "perf/max_memory_allocated_gb",
            "perf/max_memory_allocated_gb/gen",
            "perf/max_memory_allocated_gb/infer",
            "perf/max_memory_allocated_gb/train",
        }
    )
    peak = "perf/max_memory_allocated_gb"  # the step's peak on the rank (what the controller gathers)
    assert offloaded["metrics"][peak] < resident["metrics"][peak]
    train = "perf/max_memory_allocated_gb/train"
    assert offloaded["metrics"][train] < resident["metrics"][train]
    assert offloaded["params"].keys() == resident["params"].keys()
    for name, value in resident["params"].items():
        assert torch.allclose(offloaded["params"][name], value, atol=1e-6, rtol=0), name


def test_an_offload_copies_back_exactly_what_was_written_since_the_onload():
    """An unwritten unit goes back to its host copies without a copy; a write by a torch op or by the
    fused unpack kernel (through pointers) is copied back."""
    from nereus_lightning.emu import EMU
    from nereus_lightning.emu.schema import StateSchema
    from nereus_lightning.kernels.pack import pack, unpack
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.plan.units import Unit
    from tests.emu.workers import tiny

    config, model, _ = tiny("llama")
    schema, unit = StateSchema.of(config, model), Unit(Layout(1, 1), (0,))
    emu = EMU.from_model("actor_gen", schema, model, unit, 0, trains=False, device="cuda:0")
    emu.offload()
    host = {n: t.clone() for n, _, t in emu.tensors()}
    name, first = next((n, t) for n, _, t in emu.tensors())
    emu.onload()
    first.data.add_(1.0)  # a write torch does not count (through .data): seen only if the offload copies
    emu.offload()
    assert all(torch.equal(t, host[n]) for n, _, t in emu.tensors())  # no copy ran
    emu.onload()
    with torch.no_grad():
        first.add_(1.0)
    emu.offload()
    assert first.device.type == "cpu" and torch.equal(first, host[name] + 1.0)
    emu.onload()
    views = [t for _, _, t in emu.tensors()]
    fresh = [torch.randn_like(v) for v in views]
    unpack(pack(fresh), views)
    emu.offload()
    assert all(torch.equal(v, f.cpu()) for v, f in zip(views, fresh, strict=True))
