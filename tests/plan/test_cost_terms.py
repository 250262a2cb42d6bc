"""Every cost-model term against a value computed by hand."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest

from nereus_lightning.plan import compute, memory
from nereus_lightning.plan.calibration import Calibration
from nereus_lightning.plan.comm import (
    GroupLink,
    Links,
    allgather_time,
    allreduce_time,
    canonical_links,
    links_of,
    p2p_time,
)
from nereus_lightning.plan.cost import (
    DECODE_KERNELS_PER_LAYER,
    HOST_BW,
    KERNELS_PER_LAYER,
    RECOMPUTE_LAUNCH_PASSES,
    StageWork,
    decode_context,
    generation_batch,
    ideal_time,
    latency,
    peak_memory,
    rank_peak_memory,
    slot_affine,
    wave_affine,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec import ClusterSpec, GenerationEngine, model_preset

L8 = model_preset("llama3_8b")
KIB = 1024


def _cluster(gpn: int = 4, nodes: int = 4) -> ClusterSpec:
    return ClusterSpec("test", nodes, gpn, 64e9, 100e12, 1e12, 100e9, 10e9, 5e-6, 10e-6)


def _work(kind: str, role: str = "actor", model=L8, **kw) -> StageWork:
    base = dict(sequences=8, prompt_len=100, response_len=200.0, response_len_p95=300.0)
    base.update(kw)
    return StageWork(f"{role}_{kind}", kind, role, model, **base)


def test_kv_cache_llama8b_is_128kib_per_token():
    assert L8.kv_bytes_per_token() == 128 * KIB
    assert memory.kv_cache_bytes(L8, tokens=1, layers=32, tp=1) == 128 * KIB
    assert (
        memory.kv_cache_bytes(L8, tokens=1000, layers=16, tp=2) == 1000 * 32 * KIB
    )  # half the layers, half the heads


def test_training_state_is_16_bytes_per_param():
    # bf16 weights (2) + bf16 grads (2) + fp32 master/exp_avg/exp_avg_sq (12); 8,030,261,248 params.
    assert L8.num_params == 8_030_261_248
    assert memory.state_bytes_per_gpu(L8, True, Layout(1, 1)) == 16 * 8_030_261_248
    assert memory.state_bytes_per_gpu(L8, False, Layout(2, 1)) == 8_030_261_248


def test_state_max_is_at_an_end_stage():
    for pp in (1, 2, 4, 8, 16, 32):
        full = max(memory.rank_state_bytes(L8, True, Layout(1, pp), r) for r in range(pp))
        assert memory.state_bytes_per_gpu(L8, True, Layout(1, pp)) == full


def test_gemm_and_attention_flops():
    per_block = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert compute.layer_matmul_params(L8) == per_block == 218_103_808
    assert compute.gemm_flops_per_token(L8, 32, True) == 2 * (32 * per_block + 128256 * 4096)
    assert compute.attention_flops_per_token(L8, 1, 1000) == 4 * 1000 * 4096
    assert compute.training_multiplier(False) == 3 and compute.training_multiplier(True) == 4


def test_activation_and_logit_bytes():
    # Per token and block, bf16: two RMSNorms keep (4 + 2 + 2) h each (fp32 upcast, normalised,
    # output); attention 2 (3q + 2kv) + 4 per head (q, k, v, SDPA out + its log-sum-exp, o_proj
    # input); the MLP 2 x 4i (gate, silu(gate), up, product).
    assert memory.norm_bytes_per_token(L8) == 8 * 4096
    assert memory.attention_bytes_per_token(L8) == 2 * (3 * 4096 + 2 * 1024) + 4 * 32
    assert memory.mlp_bytes_per_token(L8) == 8 * 14336
    assert memory.activation_bytes_per_token_layer(L8) == 2 * 32768 + 28_800 + 114_688 == 209_024
    assert memory.forward_bytes_per_token(L8) == 2 * (2 * 4096 + 3 * 14336)
    assert memory.checkpoint_bytes_per_token_layer(L8) == 8192
    # q/k norms keep their fp32 upcast and normalised value too.
    qk = model_preset("qwen3_14b")
    plain = memory.attention_bytes_per_token(replace(qk, qk_norm=False))
    assert memory.attention_bytes_per_token(qk) - plain == 6 * (qk.q_dim + qk.kv_dim)
    # The LM head runs over chunks of 2**26 // (V / tp) rows: bf16 logits + 2 fp32 copies.
    assert memory.logit_chunk_rows(L8, 1) == 523 and memory.logit_chunk_rows(L8, 2) == 1046
    assert memory.logits_bytes(L8, rows=10, tp=2) == 10 * 64128 * 10
    assert memory.chunked_logits_bytes(L8, 100, 1) == memory.logits_bytes(L8, 100, 1)
    assert memory.chunked_logits_bytes(L8, 1e6, 1) == memory.logits_bytes(L8, 523, 1)


def test_optimizer_step_temporaries():
    # bf16: a piece's gradients upcast to fp32, then foreach AdamW's sqrt(exp_avg_sq): 8 bytes a param.
    assert memory.optimizer_step_bytes(L8, 1000) == 8000
    assert memory.optimizer_step_bytes(model_preset("tiny_llama"), 1000) == 4000  # fp32: the sqrt only
    # The step runs over pieces: a model larger than one piece pays one piece's temporaries.
    assert memory.optimizer_step_bytes(L8, L8.num_params) == 8 * memory.STEP_PIECE_ELEMENTS
    # They come after the activations are freed: the training peak holds the larger of the two.
    lay = Layout(1, 1)
    state = memory.rank_state_bytes(L8, True, lay, 0)
    short = memory.training_peak_bytes(L8, lay, 0, 1, 1, 1, False, True)
    assert short - state == memory.optimizer_step_bytes(L8, L8.num_params) < 0.1 * state


def test_gradient_collectives_hold_one_flat_bucket():
    bucket = memory.FLAT_BUCKET_BYTES
    # An all-reduce holds one bucket; a reduce-scatter or all-gather its 1 / shard side as well.
    assert memory.collective_bytes(L8, Layout(1, 1), L8.num_params) == bucket
    assert memory.collective_bytes(L8, Layout(1, 1, shard=4, zero=2), L8.num_params) == 1.25 * bucket
    assert memory.collective_bytes(L8, Layout(1, 1), 1000) == 2000  # fewer gradients than a bucket
    # ZeRO-2 on 4 ranks: the whole gradients, their fresh row blocks (bf16, a quarter) and the buffers.
    lay = Layout(1, 1, shard=4, zero=2)
    grads = 2 * L8.num_params
    assert memory.step_phase_bytes(L8, lay, 0) == 0.75 * grads + 0.25 * grads + 1.25 * bucket
    # ZeRO-0: one bucket or the AdamW step's temporaries, whichever is larger (here the step's).
    assert memory.step_phase_bytes(L8, Layout(1, 1), 0) == max(bucket, 8 * memory.STEP_PIECE_ELEMENTS)


def test_static_decoder_cache_is_the_whole_rollout():
    # The prompt region rounded up to 64 slots, then every new token but the last.
    hf = memory.BUILTIN_ENGINE
    assert hf.cache_tokens(90, 4096) == 128 + 4095 and hf.cache_tokens(64, 256) == 64 + 255
    lay = Layout(2, 1)
    one = memory.generation_peak_bytes(L8, lay, 0, 1, 90, 4096)
    two = memory.generation_peak_bytes(L8, lay, 0, 2, 90, 4096)
    kv = (128 + 4095) * 128 * KIB / 2  # a sequence's preallocated slots, KV heads over TP 2
    prefill = 90 * memory.forward_bytes_per_token(L8) / 2
    assert two - one == pytest.approx(kv + max(prefill, memory.logits_bytes(L8, 1, 2)))


def test_1f1b_in_flight_micro_batches():
    lay = Layout(1, 4)
    act = memory.activation_bytes_per_token_layer(L8)
    # stage 0 keeps 4 micro-batches in flight, stage 3 one; with only 2 micro-batches, stage 0 keeps 2.
    # (Long sequences: the activations outweigh the optimizer step's temporaries on every stage.)
    a0 = memory.training_activation_bytes(L8, 8, 16000, 4, 1, False)
    assert a0 == 4 * 16000 * 8 * act
    r0 = memory.training_peak_bytes(L8, lay, 0, 1, 16000, 16, False, False)
    r3 = memory.training_peak_bytes(L8, lay, 3, 1, 16000, 16, False, False)
    assert r0 - memory.rank_state_bytes(L8, True, lay, 0) == pytest.approx(a0)
    assert r3 - memory.rank_state_bytes(L8, True, lay, 3) == pytest.approx(a0 / 4)
    rc = memory.training_activation_bytes(L8, 8, 1000, 4, 1, True)
    assert rc == 4 * 1000 * 8 * 8192 + 1000 * act  # block inputs + one block being recomputed


def test_memory_cap_keeps_ten_percent_and_what_the_allocator_never_sees():
    assert memory.memory_cap(_cluster()) == pytest.approx(0.9 * 64e9 - 2**30)
    cpu = dataclasses.replace(_cluster(), reserved_memory=0.0)
    assert memory.memory_cap(cpu) == pytest.approx(0.9 * 64e9)


def test_collectives_alpha_beta():
    c = _cluster()
    intra, inter = GroupLink(), GroupLink(True, 4)
    assert allreduce_time(1e9, 4, intra, c) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9 + 6 * 5e-6)
    assert allreduce_time(1e9, 4, inter, c) == pytest.approx(2 * 3 / 4 * 1e9 / (10e9 / 4) + 6 * 10e-6)
    assert allgather_time(1e9, 2, intra, c) == pytest.approx(0.5 * 1e9 / 100e9 + 5e-6)
    assert p2p_time(1e6, intra, c) == pytest.approx(1e6 / 100e9 + 5e-6)
    assert allreduce_time(1e9, 1, intra, c) == 0.0


def test_tp_group_spanning_nodes_uses_the_nic():
    c = _cluster(gpn=4)
    links = links_of(tuple(range(8)), Layout(8, 1), 1, c)
    assert links.tp == GroupLink(True, 4)
    assert links_of(tuple(range(4)), Layout(4, 1), 1, c).tp == GroupLink()
    # A misplaced TP pair (GPUs 3 and 4) crosses a node boundary too.
    assert links_of((3, 4), Layout(2, 1), 1, c).tp.inter


def test_pp_and_dp_links():
    c = _cluster(gpn=4)
    links = links_of(tuple(range(8)), Layout(2, 4), 1, c)  # stages 0,1 on node 0; 2,3 on node 1
    assert links.pp == GroupLink(True, 2) and not links.tp.inter
    links = links_of(tuple(range(8)), Layout(2, 1), 4, c)  # 4 replicas over 2 nodes
    assert links.dp == GroupLink(True, 4)
    assert links_of(tuple(range(4)), Layout(2, 1), 2, c).dp == GroupLink()


def test_canonical_links_match_a_walk_over_gpus():
    for gpn in (1, 2, 4, 8):
        c = _cluster(gpn=gpn, nodes=64 // gpn)
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4):
                for dp in (1, 2, 3, 4, 8):
                    if dp * tp * pp <= 64:
                        walk = links_of(list(range(dp * tp * pp)), Layout(tp, pp), dp, c)
                        assert canonical_links(Layout(tp, pp), dp, c) == walk, (gpn, tp, pp, dp)


def test_decode_reads_weights_plus_the_whole_static_cache_and_pays_its_launches():
    c = _cluster()
    w = _work("generation", sequences=4)
    wave = wave_affine(w, Layout(2, 1), Links(), c)
    assert wave.steps == 300
    # bf16 weights / tp / HBM
    assert wave.decode_fixed == pytest.approx(2 * L8.num_params / 2 / 1e12)
    # The static decoder attends over its whole preallocated cache at every step:
    # the prompt region (100 tokens -> 128 slots) and 300 - 1 new tokens.
    slots = 128 + 299
    assert decode_context(w) == slots
    assert wave.decode_per_seq == pytest.approx(slots * 128 * KIB / 2 / 1e12)
    # One sequence: reads dominate (8 GB per step at 1 TB/s vs 15 GFLOP at 100 TFLOP/s).
    assert wave.at(1)["decode"] == pytest.approx(300 * (wave.decode_fixed + wave.decode_per_seq))
    # A replayed decode step still pays its kernels (class launch), whatever the batch.
    launch = 300 * 32 * DECODE_KERNELS_PER_LAYER * c.launch_s
    assert wave.at(1)["launch"] == wave.at(4)["launch"] == pytest.approx(launch)
    # vLLM pages its cache: a step reads the running context (prompt + half the mean response).
    paged = replace(w, engine=GenerationEngine("vllm"), gpu_memory=64e9)
    assert decode_context(paged) == 100 + 200 / 2


def test_inference_pipeline_bubble_and_offload():
    c = _cluster()
    w = _work("inference", sequences=8)
    links = canonical_links(Layout(1, 2), 1, c)
    ideal = ideal_time(w, Layout(1, 2), 1, 2, False, links, c)
    slot = slot_affine(w, Layout(1, 2), False, links, c).at(2)
    slots = 8 // 2 + 2 - 1  # a + pp - 1
    assert ideal["inference.gemm"] == pytest.approx(slots * slot["gemm"])
    assert ideal["inference.offload"] == pytest.approx(
        2 * memory.state_bytes_per_gpu(L8, False, Layout(1, 2)) / HOST_BW
    )


def test_latency_divides_by_calibrated_efficiency():
    ideal = {"training.gemm": 1.0, "training.allreduce_inter": 2.0}
    cal = Calibration({"gemm": 0.5, "training.allreduce_inter": 0.25})
    assert latency(ideal, cal) == pytest.approx(1 / 0.5 + 2 / 0.25)


def test_generation_batch_is_the_largest_that_fits():
    w = _work("generation", sequences=10_000, prompt_len=512, response_len=4096.0, response_len_p95=4096.0)
    cap = 57.6e9
    for lay in (Layout(1, 1), Layout(2, 1), Layout(4, 2)):
        b = generation_batch(w, lay, 10_000, cap)
        assert b > 0
        assert (
            max(rank_peak_memory(w, lay, 1, b, False)) <= cap < max(rank_peak_memory(w, lay, 1, b + 1, False))
        )
    assert generation_batch(w, Layout(1, 1), 3, cap) == 3  # never more than the replica's share


def test_peak_memory_shortcut_equals_all_ranks():
    for kind in ("generation", "inference", "training"):
        w = _work(kind, sequences=64)
        for lay in (Layout(1, 1), Layout(2, 4), Layout(1, 8)):
            for rc in (False, True):
                full = max(rank_peak_memory(w, lay, 2, 4, rc))
                assert peak_memory(w, lay, 2, 4, rc) == pytest.approx(full)


def test_longer_responses_never_lower_peak_memory():
    for kind in ("generation", "inference", "training"):
        prev = 0.0
        for resp in (64, 128, 512, 1024, 4096):
            w = _work(kind, sequences=16, response_len=float(resp), response_len_p95=1.2 * resp)
            peak = max(rank_peak_memory(w, Layout(2, 2), 2, 2, False))
            assert peak >= prev
            prev = peak
    assert math.isfinite(prev)


def test_optimizer_step_is_dp_allreduce_plus_adamw_traffic():
    from nereus_lightning.plan.cost import ADAMW_BYTES_PER_PARAM, _optimizer_step

    c = _cluster(gpn=4)
    w = _work("training", sequences=64)
    lay = Layout(2, 1)
    params = L8.num_params / 2  # one pipeline stage, split over TP=2
    links = canonical_links(lay, 4, c)  # 8 GPUs over two 4-GPU nodes: DP groups cross nodes
    step = _optimizer_step(w, lay, 4, links, c)
    assert step["optimizer"] == pytest.approx(params * ADAMW_BYTES_PER_PARAM / 1e12)
    assert step["allreduce_inter"] == pytest.approx(2 * 3 / 4 * params * 2 / (10e9 / 4) + 6 * 10e-6)


def test_a_sharded_step_sums_its_gradients_and_gathers_its_weights_once_whatever_its_micro_batches():
    """As ``models.zero.ZeroShards`` runs a step: the whole gradients summed once in the shard group
    (ZeRO-1 all-reduces them, ZeRO-2/3 reduce-scatter them), the weights all-gathered once (ZeRO-3
    before the pass, which holds them whole), nothing per micro-batch."""
    c = _cluster(gpn=4)
    w = _work("training", sequences=64)
    grads = L8.num_params * L8.dtype_bytes  # TP1 x PP1: the whole model on each shard rank
    gather = allgather_time(grads, 4, GroupLink(), c)
    for zero in (1, 2, 3):
        lay = Layout(1, 1, 4, zero)
        links = canonical_links(lay, 1, c)
        assert links.shard == GroupLink()  # one node
        for mb in (1, 2, 4, 16):
            ideal = ideal_time(w, lay, 1, mb, False, links, c)
            assert ideal["training.allgather_intra"] == pytest.approx(gather * (1 if zero == 1 else 2))
            assert ideal.get("training.allreduce_intra", 0.0) == pytest.approx(
                allreduce_time(grads, 4, GroupLink(), c) if zero == 1 else 0.0
            )


def test_training_slot_counts_tp_allreduces_per_block():
    c = _cluster(gpn=4)
    w = _work("training", role="critic", model=L8.as_value_model(), sequences=64)  # no LM head
    lay = Layout(2, 1)
    for rc, passes, launched in ((False, 3, 3), (True, 4, RECOMPUTE_LAUNCH_PASSES)):
        slot = slot_affine(w, lay, rc, canonical_links(lay, 1, c), c).at(1)
        tokens = 100 + 200  # prompt + mean response
        one = allreduce_time(tokens * 4096 * 2, 2, GroupLink(), c)
        assert slot["allreduce_intra"] == pytest.approx(2 * 32 * passes * one)
        gemm = (
            compute.training_multiplier(rc)
            * tokens
            * compute.gemm_flops_per_token(L8, 32, False)
            / 2
            / 100e12
        )
        launches = launched * 32 * KERNELS_PER_LAYER * c.launch_s  # forward, backward (x2), recompute
        assert slot["gemm"] == pytest.approx(gemm + launches)


def test_every_pass_of_a_slot_pays_its_layers_kernel_launches_whatever_the_batch():
    c = _cluster()
    launch = KERNELS_PER_LAYER * c.launch_s
    for kind, lay, passes, layers in (
        ("inference", Layout(1, 1), 1, 32),
        ("inference", Layout(1, 4), 1, 8),  # the slowest pipeline stage's layers
        ("training", Layout(1, 1), 3, 32),
        ("training", Layout(2, 2), 3, 16),  # TP splits the FLOPs, not the launches
    ):
        affine = slot_affine(_work(kind, sequences=16), lay, False, canonical_links(lay, 1, c), c)
        assert dict(affine.fixed)["gemm"] == pytest.approx(passes * layers * launch)
        # Affine in the batch: the launches are paid once per micro-batch, so 4 sequences in one
        # micro-batch cost less than 4 micro-batches of one.
        assert affine.at(4)["gemm"] == pytest.approx(4 * affine.at(1)["gemm"] - 3 * passes * layers * launch)


def test_optimizer_bytes_match_what_the_emu_holds():
    # fp32 weights need no master copy: weights + exp_avg + exp_avg_sq = 3 x 4 bytes.
    from nereus_lightning.plan.memory import optimizer_bytes_per_param

    assert optimizer_bytes_per_param(model_preset("tiny_llama")) == 8
    # bf16 weights: fp32 master (4) + fp32 moments (8).
    assert optimizer_bytes_per_param(model_preset("llama3_8b")) == 12


def test_dynamic_samplings_generation_rounds_multiply_the_generation_time_only():
    c = _cluster()
    links = canonical_links(Layout(1, 1), 1, c)
    one, two = (_work("generation", rounds=r) for r in (1.0, 2.5))
    t1, t2 = (ideal_time(w, Layout(1, 1), 1, 4, False, links, c) for w in (one, two))
    # every round decodes again; the idle units' offload happens once a step
    assert set(t1) == set(t2) and t2["generation.offload"] == pytest.approx(t1["generation.offload"])
    assert all(t2[k] == pytest.approx(2.5 * v) for k, v in t1.items() if k != "generation.offload")
    assert rank_peak_memory(one, Layout(1, 1), 1, 4, False) == rank_peak_memory(
        two, Layout(1, 1), 1, 4, False
    )
    # The workload's rounds reach the generation model-stages, not the others.
    from nereus_lightning.plan.cost import stage_work
    from nereus_lightning.plan.planner import job_models
    from nereus_lightning.spec import NereusConfigError, Workload

    workload = Workload(
        "grpo", prompts_per_step=8, samples_per_prompt=4, generation_rounds=2.0, reward_model=False
    )
    rounds = {ms.name: stage_work(ms, job_models(L8), workload).rounds for ms in workload.stages}
    assert rounds == {name: (2.0 if name == "actor_gen" else 1.0) for name in rounds}
    with pytest.raises(NereusConfigError, match="workload.generation_rounds"):
        Workload("grpo", generation_rounds=0.5)
