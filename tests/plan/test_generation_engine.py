"""The planner prices vLLM generation from the engine's own settings: its GPU share, its KV blocks."""

from __future__ import annotations

import math

import pytest

from nereus_lightning.plan import estimate_plan, job_models, plan_job
from nereus_lightning.plan import memory as mem
from nereus_lightning.plan.cost import generation_batch, peak_memory, rank_peak_memory, stage_work
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.memory import memory_cap
from nereus_lightning.spec import (
    GenerationEngine,
    InfeasiblePlanError,
    NereusConfigError,
    Workload,
    cluster_preset,
    model_preset,
)

L8 = model_preset("llama3_8b")
H200 = cluster_preset("h200x8")
GB = 1e9


def _vllm(util: float = 0.5, **kw) -> GenerationEngine:
    return GenerationEngine("vllm", gpu_memory_utilization=util, **kw)


def _gen(engine: GenerationEngine, gpu_memory: float = H200.gpu_memory, **workload):
    base = dict(prompts_per_step=64, prompt_len=100, response_len=200.0, response_len_p95=300.0)
    base.update(workload)
    work = Workload("grpo", generation_engine=engine, **base)
    return stage_work(work.stages[0], job_models(L8), work, gpu_memory)


def test_vllm_takes_its_share_of_every_gpu_whatever_the_batch():
    work = _gen(_vllm(0.5))
    assert work.reserved == 0.5 * H200.gpu_memory
    for tp, batch in ((1, 1), (1, 8), (2, 1), (4, 16)):
        assert peak_memory(work, Layout(tp, 1), 64 // batch, batch, False) == 0.5 * H200.gpu_memory
        assert rank_peak_memory(work, Layout(tp, 1), 1, batch, False) == (0.5 * H200.gpu_memory,)
    # The built-in engine holds what its batch needs: more with more sequences.
    hf = _gen(GenerationEngine())
    assert hf.reserved == 0.0
    assert peak_memory(hf, Layout(1, 1), 64, 1, False) < peak_memory(hf, Layout(1, 1), 8, 8, False)


def test_vllm_counts_kv_cache_in_whole_blocks():
    hf, vllm = GenerationEngine(), _vllm()  # vLLM's block on CUDA: 16 tokens
    assert vllm.cache_tokens(100, 300) == 400 and vllm.cache_tokens(100, 301) == 416
    assert _vllm(block_size=128).cache_tokens(100, 301) == 512
    # The static decoder preallocates its prompt region (rounded up to 64 slots) and all new tokens
    # but the last.
    assert hf.cache_tokens(100, 301) == 128 + 300
    lay = Layout(2, 1)
    fewer = mem.generation_peak_bytes(L8, lay, 0, 8, 100, 301, hf) - mem.generation_peak_bytes(
        L8, lay, 0, 8, 100, 301, vllm
    )
    assert fewer == 8 * 12 * 128 * 1024 / 2  # 12 fewer tokens a sequence, 128 KiB each, KV heads over TP 2


def test_vllm_decodes_as_many_sequences_as_its_share_holds():
    work, lay = _gen(_vllm(0.5)), Layout(1, 1)
    base = mem.generation_peak_bytes(L8, lay, 0, 0, 100, 300, work.engine)
    per_seq = mem.generation_peak_bytes(L8, lay, 0, 1, 100, 300, work.engine) - base
    fits = math.floor((0.5 * H200.gpu_memory - base) / per_seq)
    assert 0 < fits < 10_000
    # Its share, not the GPU's free memory, bounds the batch; a share that does not fit: nothing runs.
    assert generation_batch(work, lay, 10_000, memory_cap(H200)) == fits
    assert generation_batch(work, lay, 10_000, 0.6 * H200.gpu_memory) == fits
    assert generation_batch(work, lay, 10_000, 0.4 * H200.gpu_memory) == 0
    assert generation_batch(work, lay, 3, memory_cap(H200)) == 3  # never more than the replica's share
    hf = _gen(GenerationEngine())
    assert (
        generation_batch(hf, lay, 10_000, memory_cap(H200)) > fits
    )  # the built-in engine grows into the cap


def test_plans_leave_room_for_vllm_beside_the_training_state():
    """GRPO-8B on 2 H200s: every model-stage shares both GPUs with the actor's training state (at least
    64 GB a GPU). A 0.5 share (70.5 GB) does not fit beside it under the 126.9 GB cap, a 0.4 share does;
    the built-in engine's plan, priced with vLLM at 0.5, would overcommit its GPUs."""
    models, cluster = job_models(L8), H200.with_gpus(2)
    sizes = dict(prompts_per_step=32, prompt_len=256, response_len=512.0)
    builtin = plan_job(models, cluster, Workload("grpo", **sizes))
    assert builtin.estimate.feasible
    at_half = Workload("grpo", generation_engine=_vllm(0.5), **sizes)
    with pytest.raises(
        InfeasiblePlanError, match=r"actor_gen .* lower algorithm.vllm.gpu_memory_utilization \(0.5"
    ):
        plan_job(models, cluster, at_half)
    overcommitted = estimate_plan(builtin.plan, models, cluster, at_half)
    assert not overcommitted.feasible and any("actor_gen" in v for v in overcommitted.violations)
    at_04 = plan_job(models, cluster, Workload("grpo", generation_engine=_vllm(0.4), **sizes))
    est = at_04.estimate
    assert est.feasible and max(est.peak_memory.values()) <= est.memory_cap
    training = mem.boundary_state_bytes(L8, True, at_04.plan["actor_train"].layout)
    assert training >= 56 * GB  # next to vLLM's share on the same GPU
    assert est.stage_memory["actor_gen"] == pytest.approx(0.4 * cluster.gpu_memory + training)


def test_engine_settings_are_checked_naming_their_key():
    with pytest.raises(NereusConfigError, match="algorithm.rollout_engine: 'sglang'"):
        GenerationEngine("sglang")
    with pytest.raises(
        NereusConfigError, match=r"algorithm.vllm.gpu_memory_utilization: must be in \(0, 1\]"
    ):
        _vllm(1.5)
    with pytest.raises(NereusConfigError, match="algorithm.vllm.block_size"):
        _vllm(block_size=0)
    with pytest.raises(NereusConfigError, match="algorithm.vllm.max_model_len"):
        _vllm(max_model_len=0)
    with pytest.raises(
        NereusConfigError, match=r"algorithm.vllm: unknown setting\(s\) \['swap_space'\]; valid: "
    ):
        GenerationEngine.of("vllm", {"swap_space": 4})
    assert GenerationEngine.of("vllm", {"block_size": 32, "max_model_len": None}) == _vllm(block_size=32)
    with pytest.raises(NereusConfigError, match="needs the GPU's memory"):
        _gen(_vllm(), gpu_memory=0.0)


def test_the_engine_settings_reach_the_planner_from_the_configs(tmp_path):
    """The engine settings of nereus-plan (workload.generation_engine) and nereus-train (algorithm.vllm)."""
    import json

    from nereus_lightning.cli.plan import plan_config, plan_from_config
    from nereus_lightning.cli.train import _workload, train_config

    out = tmp_path / "plan.json"
    overrides = [
        "model=llama3_8b",
        "cluster=h200x8",
        "cluster.num_gpus=2",
        "algorithm=grpo",
        f"output.json={out}",
    ]
    vllm = ["workload.generation_engine.kind=vllm", "workload.generation_engine.gpu_memory_utilization=0.3"]
    result = plan_from_config(plan_config(overrides + vllm))
    row = next(r for r in result["model_stages"] if r["model_stage"] == "actor_gen")
    assert row["peak_memory_bytes"] >= 0.3 * H200.gpu_memory
    assert json.loads(out.read_text())["workload"]["generation_engine"]["gpu_memory_utilization"] == 0.3

    cfg = train_config(["algorithm=grpo", "algorithm.rollout_engine=vllm", "algorithm.vllm.block_size=32"])
    assert _workload(cfg, 64.0).generation_engine == _vllm(0.5, block_size=32)
