"""Eager vs static-cache (CUDA-graph) decode on one GPU: ms per decoded token, and how many tokens differ.

A random model of a Qwen2 shape (0.5B by default) as one rank's ``ShardedCausalLM`` (Layout(1, 1)),
a batch of left-padded prompts (16 prompts x 4 samples = 64 rows), every response ``--new-tokens``
long (no eos: ``ignore_eos``). Both engines sample with the same per-row seeds:

- eager: ``HFGenerateEngine`` over ``ShardedGenerator`` (transformers ``generate``, dynamic cache);
- static: ``engines.static.StaticDecodeEngine`` (static KV cache, prefill eager, decode steps replayed
  as CUDA graphs; ``--mode compiled``, the default: the stage's forward compiled by torch.compile
  before capture). Its first call builds the decoder (compile, cache and graph capture); later calls
  reuse it.

Printed: ms per decoded token (whole ``generate`` / new tokens) and generated tokens/s for both,
the static path's prefill and per-step time, the one-off capture time, the memory-bandwidth floor of
a decode step (weights read once), peak memory; in ``--dtype bf16`` the share of response tokens that
differ from the eager path's (sampled and greedy); and an fp32 check on the same shape: the largest
decode-step logit difference to the eager path (must be <= 1e-5) and whether the tokens agree.

    python benchmarks/gpu_decode.py                      # 0.5B shape, bf16, 64 x 256 tokens
    python benchmarks/gpu_decode.py --shape 1.5b --out $OUT/gpu_decode_1.5b.json
    # CPU smoke run:
    python benchmarks/gpu_decode.py --shape tiny --batch 4 --prompt-len 8 --new-tokens 8 --fp32-tokens 4

Without a GPU it runs on the CPU (no graphs; the timings then mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPES = {  # Qwen2-0.5B and Qwen2-1.5B (tied embeddings, 2 KV heads), and a tiny one for a CPU smoke run
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}
VOCAB = {"0.5b": 151936, "1.5b": 151936, "tiny": 512}
HBM_BYTES_PER_S = 4.8e12  # H200
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_unit(shape: str, dtype: torch.dtype):  # noqa: ANN201
    """A random Qwen2 model of ``shape`` as a one-rank ShardedCausalLM on :data:`DEVICE`."""
    import transformers as tf

    from nereus_lightning.models import ReplicaComm, ShardedCausalLM

    config = tf.Qwen2Config(
        **SHAPES[shape],
        num_key_value_heads=2,
        vocab_size=VOCAB[shape],
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with DEVICE:
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    unit = ShardedCausalLM.from_model(model, ReplicaComm.single())
    del model
    return unit


def prompts(batch: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random left-padded prompts and one seed per row.

    Row i is padded by 8 * (i % 8) tokens, at most half the width.
    """
    from nereus_lightning.engines.base import sample_seeds

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : min(8 * (row % 8), width // 2)] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(DEVICE), mask.to(DEVICE), sample_seeds(0, 0, range(batch))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall seconds (GPU work included)."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def sync() -> None:
    """Wait for the GPU."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    """Start a peak-memory window."""
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    """Peak GPU memory of the window (0 on the CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0.0


def engines(unit, mode: str) -> tuple[Any, Any]:  # noqa: ANN001
    """The eager and the static engine (``mode``: static or compiled) over ``unit``, both without an
    eos (fixed-length responses)."""
    from nereus_lightning.engines.hf import HFGenerateEngine
    from nereus_lightning.engines.static import StaticDecodeEngine
    from nereus_lightning.models.generation import ShardedGenerator

    fast = StaticDecodeEngine(unit, None, 0, compiled=mode == "compiled")
    return HFGenerateEngine(ShardedGenerator(unit), None, 0), fast


def speed(unit, args: argparse.Namespace) -> dict[str, Any]:  # noqa: ANN001
    """Timings of both engines and the bf16 token agreement."""
    from nereus_lightning.engines import static as decode

    vocab = unit.config.vocab_size
    ids, mask, seeds = prompts(args.batch, args.prompt_len, vocab)
    eager, static = engines(unit, args.mode)
    n = args.new_tokens
    eager.generate(ids, mask, 4, sample_seeds=seeds)  # warm-up (kernels, allocator)
    reset_peak()
    want, eager_s = timed(lambda: eager.generate(ids, mask, n, sample_seeds=seeds))
    eager_peak = peak_gib()
    reset_peak()
    got, first_s = timed(lambda: static.generate(ids, mask, n, sample_seeds=seeds))
    runs = [timed(lambda: static.generate(ids, mask, n, sample_seeds=seeds))[1] for _ in range(args.repeats)]
    static_peak = peak_gib()
    static_s = statistics.median(runs)
    decoder = decode._DECODERS[unit]
    _, prefill_s = timed(lambda: decoder.start(unit, ids, mask, seeds))
    _, steps_s = timed(lambda: [decoder.step(unit) for _ in range(n - 1)])
    greedy_want = eager.generate(ids, mask, n, do_sample=False)
    greedy_got = static.generate(ids, mask, n, do_sample=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in unit.parameters())
    tokens = args.batch * n
    return {
        "eager_ms_per_token": 1e3 * eager_s / n,
        "static_ms_per_token": 1e3 * static_s / n,
        "speedup": eager_s / static_s,
        "eager_tokens_per_s": tokens / eager_s,
        "static_tokens_per_s": tokens / static_s,
        "static_prefill_ms": 1e3 * prefill_s,
        "static_step_ms": 1e3 * steps_s / (n - 1),
        "static_first_call_s": first_s,
        "capture_s": first_s - static_s,
        "floor_step_ms": 1e3 * weight_bytes / HBM_BYTES_PER_S,
        "eager_peak_gib": eager_peak,
        "static_peak_gib": static_peak,
        "sampled_tokens_differ": differ_share(want.response_ids, got.response_ids),
        "greedy_tokens_differ": differ_share(greedy_want.response_ids, greedy_got.response_ids),
        "sampled_rows_identical": rows_identical(want.response_ids, got.response_ids),
        "sampled_first_divergence_mean": first_divergence(want.response_ids, got.response_ids),
    }


def profile_steps(unit, args: argparse.Namespace) -> None:  # noqa: ANN001
    """Print where ``args.profile`` static decode steps spend their GPU time (torch.profiler, top kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from nereus_lightning.engines import static as decode

    ids, mask, seeds = prompts(args.batch, args.prompt_len, unit.config.vocab_size)
    decoder = decode._DECODERS[unit]
    decoder.start(unit, ids, mask, seeds)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile):
            decoder.step(unit)
        sync()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=50)
    print(table)


def differ_share(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of response tokens that differ."""
    return float((a != b).float().mean())


def rows_identical(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of rows whose whole response agrees."""
    return float((a == b).all(-1).float().mean())


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean index of a row's first differing token (the response length where none differs)."""
    same = (a == b).long().cumprod(-1)
    return float(same.sum(-1).float().mean())


def fp32_check(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """Largest decode-step logit difference between the two paths in fp32, and token agreement."""
    from nereus_lightning.engines import static as decode

    unit = build_unit(shape, torch.float32)
    vocab = unit.config.vocab_size
    ids, mask, seeds = prompts(args.batch, args.prompt_len, vocab)
    eager, static = engines(unit, args.mode)
    n = args.fp32_tokens
    seen: list[torch.Tensor] = []
    eager.model.register_forward_hook(
        lambda module, inputs, out: seen.append(out.logits[:, -1].float().clone())
    )
    want = eager.generate(ids, mask, n, sample_seeds=seeds)
    got = static.generate(ids, mask, n, sample_seeds=seeds)
    decoder = decode._DECODERS[unit]
    decoder.start(unit, ids, mask, seeds)
    errs = [float((seen[0] - decoder.logits).abs().max())]
    for step in range(1, n):
        decoder.step(unit)
        errs.append(float((seen[step] - decoder.logits).abs().max()))
    return {
        "fp32_max_logit_err": max(errs),
        "fp32_logit_scale": float(torch.stack(seen).abs().max()),
        "fp32_same_tokens": bool(torch.equal(want.response_ids, got.response_ids)),
        "fp32_tokens": n,
    }


def main() -> None:
    """Run, print, write the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--mode", choices=("static", "compiled"), default="compiled")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp32-tokens", type=int, default=32, help="tokens of the fp32 check (0: skip it)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile", type=int, default=0, help="profile this many static decode steps (GPU time per kernel)"
    )
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the 1e-5 check)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    result["device"] = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    unit = build_unit(args.shape, dtype)
    result.update(speed(unit, args))
    if args.profile:
        profile_steps(unit, args)
    del unit
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    if args.fp32_tokens:
        result.update(fp32_check(args.shape, args))
    for key, value in result.items():
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
