"""The static-cache decode (``engines.static``) samples the eager path's tokens from the eager path's logits.

The eager path is :class:`HFGenerateEngine` over a :class:`ShardedGenerator` (transformers ``generate``
with a dynamic cache). On the CPU both run without graphs (gloo, TP and PP replicas); on CUDA the
decode steps replay CUDA graphs (tests marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from nereus_lightning.engines import static as decode
from nereus_lightning.engines.base import SeededGumbel, make_picker, sample_seeds
from nereus_lightning.engines.hf import HFGenerateEngine
from nereus_lightning.engines.static import StaticDecodeEngine, seeded_scores
from nereus_lightning.models import ReplicaComm, ShardedCausalLM
from nereus_lightning.models.generation import ShardedGenerator
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.families import FAMILIES
from nereus_lightning.testing.shrink import tiny_config_of, tiny_model_of, value_config_of
from nereus_lightning.testing.tiny import my_replica, tiny_model

EOS = 255
TOL = 1e-5
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SAMPLINGS = {
    "sampled": dict(),
    "greedy": dict(do_sample=False),
    "top_k_top_p": dict(temperature=0.7, top_k=20, top_p=0.8),
}
DISTRIBUTED_SAMPLINGS = ("sampled", "greedy")  # top-k / top-p on one rank (every family)
STEPS = 8
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph decode)")


def _prompts(
    index: int, rows: int = 3, width: int = 7, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(20 + index)  # replicas see different prompts
    ids = torch.randint(0, 250, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    ids[0, :3] = 0
    mask[-1, :1] = 0
    ids[-1, :1] = 0
    seeds = sample_seeds(0, 1, [rows * index + i for i in range(rows)])
    return ids.to(device), mask.to(device), seeds


def eager_decode(unit: ShardedCausalLM, ids, mask, n: int, **kw):  # noqa: ANN001, ANN201
    """The eager path's responses and its logits at every decoding step ``[B, steps, V]`` (float32)."""
    generator = ShardedGenerator(unit)
    seen: list[torch.Tensor] = []
    generator.register_forward_hook(lambda module, args, out: seen.append(out.logits[:, -1].float().clone()))
    out = HFGenerateEngine(generator, EOS, 0).generate(ids, mask, n, **kw)
    return out, torch.stack(seen, 1)


def fast_decode(unit: ShardedCausalLM, ids, mask, n: int, compiled: bool = False, **kw):  # noqa: ANN001, ANN201
    """The static decode's responses, then its decoder driven step by step for its logits ``[B, n, V]``."""
    out = StaticDecodeEngine(unit, EOS, 0, compiled=compiled).generate(ids, mask, n, **kw)
    decoder = decode._DECODERS[unit]
    decoder.start(unit, ids, mask, kw.get("sample_seeds"))
    logits = [decoder.logits.float().clone()]  # the decoder's buffer is overwritten every step
    for _ in range(n - 1):
        decoder.step(unit)
        logits.append(decoder.logits.float().clone())
    return out, torch.stack(logits, 1)


def compare(  # noqa: ANN001
    unit: ShardedCausalLM, ids, mask, seeds, n: int, sampling: dict, compiled: bool = False
) -> dict[str, object]:
    """Same tokens and masks; the largest decode-step logit difference (last-stage ranks hold logits)."""
    kw = sampling if sampling.get("do_sample", True) is False else {**sampling, "sample_seeds": seeds}
    want, want_logits = eager_decode(unit, ids, mask, n, **kw)
    got, got_logits = fast_decode(unit, ids, mask, n, compiled, **kw)
    steps = want_logits.shape[1]
    err = float((want_logits - got_logits[:, :steps]).abs().max()) if unit.comm.is_last_stage else 0.0
    return {
        "same_tokens": torch.equal(want.response_ids, got.response_ids)
        and torch.equal(want.response_mask, got.response_mask),
        "logit_err": err,
        "steps": steps,
    }


def _decode_on_replicas(rank: int, world: int, kind: str, compiled: bool) -> dict[str, object]:
    model = tiny_model(kind, attn_implementation="sdpa" if compiled else "eager")
    tied = bool(model.config.tie_word_embeddings)
    out: dict[str, object] = {}
    for tp, pp in LAYOUTS[1:3] if compiled else LAYOUTS:  # compiled: TP2 and PP2 (compiling is slow here)
        index, comm = my_replica(rank, world, Layout(tp, pp), tied)
        unit = ShardedCausalLM.from_model(model, comm)
        ids, mask, seeds = _prompts(index)
        for name in DISTRIBUTED_SAMPLINGS:
            for key, value in compare(unit, ids, mask, seeds, STEPS, SAMPLINGS[name], compiled).items():
                out[f"tp{tp}pp{pp}/{name}/{key}"] = value
    return out


@pytest.mark.parametrize(
    ("kind", "compiled"), [("gqa_tied", False), ("mistral", False), ("gqa_tied", True)]
)  # compiled: TP collectives and pipeline sends around a torch.compile'd stage
def test_static_decode_matches_eager_on_tp_and_pp_replicas(dist4, kind: str, compiled: bool) -> None:
    for rank, out in enumerate(dist4.run(_decode_on_replicas, kind, compiled)):
        for tp, pp in LAYOUTS[1:3] if compiled else LAYOUTS:
            for name in DISTRIBUTED_SAMPLINGS:
                key = f"tp{tp}pp{pp}/{name}"
                assert out[f"{key}/same_tokens"], f"rank {rank} {kind} {key}: tokens differ"
                assert out[f"{key}/logit_err"] <= TOL, f"rank {rank} {kind} {key}: {out[f'{key}/logit_err']}"
                assert out[f"{key}/steps"] == STEPS, f"rank {rank} {kind} {key}: eager stopped early"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_decodes_as_eager(model_type: str) -> None:
    config = tiny_config_of(tf.AutoConfig.for_model(model_type, num_attention_heads=8, num_key_value_heads=4))
    unit = ShardedCausalLM.from_model(tiny_model_of(config), ReplicaComm.single())
    ids, mask, seeds = _prompts(0, rows=4, width=9)  # longer than the sliding windows (6)
    result = compare(unit, ids, mask, seeds, 12, SAMPLINGS["top_k_top_p"])
    assert result["same_tokens"], f"{model_type}: tokens differ"
    assert result["logit_err"] <= TOL, f"{model_type}: decode-step logits differ by {result['logit_err']}"


def test_the_draw_at_a_tensor_step_is_the_eager_draw() -> None:
    # The captured step reads its step from a tensor; its noise must be bitwise the eager one's.
    seeds = sample_seeds(3, 7, range(5))
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    static = make_picker(5, 0, 8, True, 0.7, 40, 0.9, seeds)
    for step in range(6):
        eager = SeededGumbel(seeds, 4, 8, 0.7, 40, 0.9)(torch.zeros(5, 4 + step, dtype=torch.long), logits)
        step_seeds = torch.tensor(seeds)
        assert torch.equal(seeded_scores(static, logits, step_seeds, torch.tensor(step)), eager), step


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_a_decoder_is_kept_per_shape_and_rebuilt_when_the_weights_move(device: str) -> None:
    unit = ShardedCausalLM.from_model(tiny_model("qwen2").to(device), ReplicaComm.single())
    ids, mask, seeds = _prompts(0, device=device)
    assert compare(unit, ids, mask, seeds, 6, {})["same_tokens"]
    first = decode._DECODERS[unit]
    wider, wider_mask, _ = _prompts(1, width=11, device=device)  # the same prompt bucket: the same decoder
    assert compare(unit, wider, wider_mask, seeds, 6, {})["same_tokens"]
    assert decode._DECODERS[unit] is first
    with torch.no_grad():  # an in-place update (an optimizer step) is seen without a rebuild
        unit.model.norm.weight.mul_(1.5)
    assert compare(unit, ids, mask, seeds, 6, {})["same_tokens"]
    assert decode._DECODERS[unit] is first
    layer = unit.model.layers["1"].mlp.up_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * -1.0)  # a new tensor: a new decoder
    result = compare(unit, ids, mask, seeds, 6, {})
    assert result["same_tokens"] and result["logit_err"] <= TOL
    assert decode._DECODERS[unit] is not first
    assert compare(unit, ids, mask, seeds, 9, {})["same_tokens"]  # another length: another decoder


def test_the_decode_mode_picks_compiled_on_cuda_only_when_auto() -> None:
    unit = ShardedCausalLM.from_model(tiny_model("llama"), ReplicaComm.single())
    modes = ("auto", "eager", "static", "compiled")
    assert [decode.decode_path(m, unit) for m in modes] == ["eager", "eager", "static", "compiled"]
    with pytest.raises(NereusConfigError, match="algorithm.decode.*'fast' is not one of"):
        decode.decode_path("fast", unit)


def test_the_packed_decode_attention_is_transformers_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(3)
    module = torch.nn.Module()
    module.num_key_value_groups = 4
    query, key, value = (torch.randn(3, h, s, 16, generator=gen) for h, s in ((8, 1), (2, 11), (2, 11)))
    mask = torch.zeros(3, 1, 1, 11).masked_fill_(torch.rand(3, 1, 1, 11, generator=gen) < 0.3, -1e30)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, _ = decode.decode_attention(module, query, key, value, mask, scaling=0.25)
    assert got.shape == want.shape == (3, 1, 8, 16)
    assert torch.allclose(got, want, atol=1e-6), float((got - want).abs().max())


def test_a_compiler_failure_names_the_decode_mode_to_use(monkeypatch) -> None:  # noqa: ANN001
    def no_compiler(graph, inputs):  # noqa: ANN001, ANN202
        raise OSError("no C compiler")

    failing = torch.compile(ShardedCausalLM.stage, backend=no_compiler, dynamic=False)
    monkeypatch.setattr(decode, "compiled_stage", lambda: failing)
    unit = ShardedCausalLM.from_model(tiny_model("qwen2"), ReplicaComm.single())
    ids, mask, seeds = _prompts(0, rows=2, width=5)
    with pytest.raises(NereusConfigError, match="algorithm.decode: torch.compile could not.*no C compiler"):
        StaticDecodeEngine(unit, EOS, 0, compiled=True).generate(ids, mask, 3, sample_seeds=seeds)


def test_the_compiled_stage_samples_the_eager_tokens_on_the_cpu() -> None:
    model = tiny_model("qwen2", attn_implementation="sdpa")  # GQA through the packed decode attention
    unit = ShardedCausalLM.from_model(model, ReplicaComm.single())
    assert unit.local_config._attn_implementation == "sdpa"
    ids, mask, seeds = _prompts(0, rows=4, width=9)
    result = compare(unit, ids, mask, seeds, 6, SAMPLINGS["sampled"], compiled=True)
    assert result["same_tokens"] and result["logit_err"] <= TOL, result


def test_a_value_model_is_refused() -> None:
    config = value_config_of(tiny_config_of(tf.AutoConfig.for_model("llama")))
    unit = ShardedCausalLM.from_model(tiny_model_of(config), ReplicaComm.single())
    with pytest.raises(NereusConfigError, match="rollout.engine.*value model"):
        StaticDecodeEngine(unit, EOS, 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("compiled", [False, True], ids=["static", "compiled"])
def test_cuda_graph_decode_matches_eager_in_fp32(kind: str, sampling: str, compiled: bool) -> None:
    model = tiny_model(kind, attn_implementation="sdpa" if compiled else "eager")
    unit = ShardedCausalLM.from_model(model.cuda(), ReplicaComm.single())
    ids, mask, seeds = _prompts(0, rows=8, width=20, device="cuda")
    result = compare(unit, ids, mask, seeds, 24, SAMPLINGS[sampling], compiled)
    assert result["same_tokens"], f"{kind} {sampling}: tokens differ"
    assert result["logit_err"] <= TOL, (
        f"{kind} {sampling}: decode-step logits differ by {result['logit_err']}"
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["static", "compiled"])
def test_cuda_graph_decode_in_bf16_samples_nearly_the_eager_tokens(compiled: bool) -> None:
    model = tiny_model("qwen2", attn_implementation="sdpa" if compiled else "eager")
    unit = ShardedCausalLM.from_model(model.to("cuda", torch.bfloat16), ReplicaComm.single())
    ids, mask, seeds = _prompts(0, rows=16, width=20, device="cuda")
    want, want_logits = eager_decode(unit, ids, mask, 32, sample_seeds=seeds)
    got, got_logits = fast_decode(unit, ids, mask, 32, compiled, sample_seeds=seeds)
    differ = (want.response_ids != got.response_ids).float().mean().item()
    print(f"bf16: {differ:.1%} of the tokens differ from the eager path's")
    # Until a row's tokens part, both paths read the same sequence: logits agree to bf16 precision.
    same = (want.response_ids == got.response_ids).long().cumprod(-1).bool()
    same = torch.cat([torch.ones_like(same[:, :1]), same[:, :-1]], dim=-1)
    err = ((want_logits - got_logits) * same.unsqueeze(-1)).abs().max().item()
    assert err <= 0.05 * want_logits.abs().max().item(), f"bf16 logits differ by {err}"
    assert differ <= 0.2, f"bf16: {differ:.1%} of the tokens differ"


def _nccl_worker(rank: int, world: int, port: int, queue) -> None:  # noqa: ANN001
    import os

    import torch.distributed as dist

    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[key] = "0" if key == "NCCL_NVLS_ENABLE" else "1"  # NVLink multicast off
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    try:
        model = tiny_model("gqa_tied").cuda()
        out = {}
        for tp, pp in ((2, 1), (1, 2)):
            index, comm = my_replica(rank, world, Layout(tp, pp), tied=True)
            unit = ShardedCausalLM.from_model(model, comm)
            ids, mask, seeds = _prompts(index, rows=8, width=20, device="cuda")
            for name, sampling in SAMPLINGS.items():
                out[f"tp{tp}pp{pp}/{name}"] = compare(unit, ids, mask, seeds, 16, sampling)
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (TP and PP on NCCL)")
def test_cuda_graph_decode_on_nccl_tp2_and_pp2_matches_eager() -> None:
    import torch.multiprocessing as mp

    from nereus_lightning.testing.pool import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, out in results.items():
        for key, result in out.items():
            assert result["same_tokens"], f"rank {rank} {key}: tokens differ"
            assert result["logit_err"] <= TOL, f"rank {rank} {key}: logits differ by {result['logit_err']}"


def test_without_an_eos_every_row_runs_to_the_budget_as_eager() -> None:
    unit = ShardedCausalLM.from_model(tiny_model("gqa_tied"), ReplicaComm.single())
    ids, mask, seeds = _prompts(0)
    want = HFGenerateEngine(ShardedGenerator(unit), None, 0).generate(ids, mask, 9, sample_seeds=seeds)
    got = StaticDecodeEngine(unit, None, 0).generate(ids, mask, 9, sample_seeds=seeds)
    assert torch.equal(want.response_ids, got.response_ids) and bool(got.response_mask.all())


def test_prompts_that_are_not_left_padded_are_refused() -> None:
    unit = ShardedCausalLM.from_model(tiny_model("llama"), ReplicaComm.single())
    ids, mask, seeds = _prompts(0)
    mask[1, -1] = 0  # right padding
    with pytest.raises(NereusConfigError, match="attention_mask.*left-padded"):
        StaticDecodeEngine(unit, EOS, 0).generate(ids, mask, 4, sample_seeds=seeds)


def test_the_gpu_decode_benchmark_runs_on_the_cpu(tmp_path) -> None:  # noqa: ANN001
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu_decode.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root / "src")}
    cmd = [
        sys.executable, str(root / "benchmarks" / "gpu_decode.py"), "--shape", "tiny", "--batch", "4",
        "--prompt-len", "12", "--new-tokens", "6", "--repeats", "1", "--fp32-tokens", "4", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert result["fp32_same_tokens"] and result["fp32_max_logit_err"] <= TOL
    assert 0.0 <= result["sampled_tokens_differ"] <= 1.0 and result["static_ms_per_token"] > 0
