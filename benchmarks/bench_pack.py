"""Pack / unpack of resharding transfers (Llama-3.1-8B TP slices): fused kernel vs torch loop vs copy ceiling.

For each TP transition (1->2, 2->4, 4->2, 2->1) one (old rank -> new rank) transfer is built from
the model's 291 HF parameters: the source views are the slices of the old rank's shards that the
new rank needs (column-parallel row blocks, row-parallel column blocks, whole norms), the
destination views the matching slices of the new rank's shards. Timed on the current device:
``pack`` (views -> buffer) and ``unpack`` (buffer -> views) through the public dispatch (fused
kernel on a GPU), the per-tensor torch loop (the reference), and a device-to-device copy of the
same number of bytes (the ceiling; bandwidth counts bytes read + written). GPU: CUDA events,
warm-up, median of repeats. On a CPU-only machine a tiny model runs through the reference.

Usage: ``python benchmarks/bench_pack.py [--model llama3_8b] [--repeats 15] [--variants] [--out PATH]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nereus_lightning.kernels import _ext, kernel_status, pack, pack_reference, unpack, unpack_reference
from nereus_lightning.spec import ModelSpec, model_preset

HERE = Path(__file__).resolve().parent
TRANSITIONS = ((1, 2, 0, 1), (2, 4, 0, 1), (4, 2, 1, 0), (2, 1, 1, 0))  # old_tp, new_tp, old_rank, new_rank
CEILING_BYTES = 4 << 30
# Tunable variants timed with --variants (each is a separate build of the same sources).
VARIANTS = {
    "unroll8_minblocks2": ("NEREUS_PACK_UNROLL=8", "NEREUS_PACK_MIN_BLOCKS=2"),
    "threads256_minblocks3": ("NEREUS_PACK_THREADS=256", "NEREUS_PACK_MIN_BLOCKS=3"),
}


def _sharding():
    """``models/sharding.py`` alone (pure Python), without the model stack ``models/__init__`` imports."""
    import nereus_lightning

    path = Path(nereus_lightning.__file__).parent / "models" / "sharding.py"
    spec = importlib.util.spec_from_file_location("nereus_lightning_models_sharding", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def hf_parameter_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names and full shapes (291 tensors for Llama-3.1-8B)."""
    h, q, kv, inter = model.hidden, model.q_dim, model.kv_dim, model.intermediate
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (model.vocab, h)}
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not model.tie_embeddings:
        shapes["lm_head.weight"] = (model.vocab, h)
    return shapes


def transfer_views(shapes, old_tp, new_tp, old_rank, new_rank, dtype, device):
    """Old rank's shards, new rank's shards, and the (source, destination) views of what moves."""
    sharding = _sharding()
    sources, targets, shards = [], [], []
    for name, shape in shapes.items():
        p = sharding.placement(name)
        old = torch.randn(sharding.shard_shape(shape, p, old_tp), device=device, dtype=torch.float32).to(
            dtype
        )
        new = torch.empty(sharding.shard_shape(shape, p, new_tp), device=device, dtype=dtype)
        shards += [old, new]
        if p.tp_dim is None:
            sources.append(old)
            targets.append(new)
            continue
        o = sharding.tp_slices(shape, p, old_tp, old_rank)[p.tp_dim]
        n = sharding.tp_slices(shape, p, new_tp, new_rank)[p.tp_dim]
        o_start, o_stop = (o.start or 0, o.stop if o.stop is not None else shape[p.tp_dim])
        n_start, n_stop = (n.start or 0, n.stop if n.stop is not None else shape[p.tp_dim])
        lo, hi = max(o_start, n_start), min(o_stop, n_stop)
        if lo >= hi:
            continue
        src = old.narrow(p.tp_dim, lo - o_start, hi - lo)
        dst = new.narrow(p.tp_dim, lo - n_start, hi - lo)
        sources.append(src)
        targets.append(dst)
    return sources, targets, shards


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU, wall clock otherwise)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_ceiling(device: torch.device, nbytes: int, warmup: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written) over ``nbytes``."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * nbytes / seconds


def _time_transition(shapes, transition, dtype, device, ceiling, loaded, variants, args) -> dict:
    """Time pack/unpack (kernel, loop, variants) for one (old_tp, new_tp, old_rank, new_rank) transfer."""
    old_tp, new_tp, old_rank, new_rank = transition
    sources, targets, _shards = transfer_views(shapes, old_tp, new_tp, old_rank, new_rank, dtype, device)
    nbytes = sum(v.numel() * v.element_size() for v in sources)
    buffer = pack_reference(sources)
    row = {
        "transition": f"{old_tp}->{new_tp}",
        "old_rank": old_rank,
        "new_rank": new_rank,
        "tensors": len(sources),
        "bytes": nbytes,
        "buffer_bytes": buffer.numel(),
    }
    timings = {
        "pack": lambda: pack(sources, buffer),
        "pack_loop": lambda: pack_reference(sources, buffer),
        "unpack": lambda: unpack(buffer, targets),
        "unpack_loop": lambda: unpack_reference(buffer, targets),
    }
    for chunk in args.chunks if loaded else []:
        timings[f"pack_chunk{chunk}"] = lambda c=chunk: _ext.copy_views(sources, buffer, True, c)
        timings[f"unpack_chunk{chunk}"] = lambda c=chunk: _ext.copy_views(targets, buffer, False, c)
    for name, module in variants.items():
        for chunk in sorted({_ext.DEFAULT_CHUNK_BYTES, *args.chunks}):
            timings[f"pack_{name}_chunk{chunk}"] = lambda m=module, c=chunk: m.copy_views(
                sources, buffer, True, c
            )
            timings[f"unpack_{name}_chunk{chunk}"] = lambda m=module, c=chunk: m.copy_views(
                targets, buffer, False, c
            )
    for name, fn in timings.items():
        seconds = timed(fn, device, args.warmup, args.repeats)
        row[f"{name}_ms"] = round(seconds * 1e3, 4)
        row[f"{name}_GBps"] = round(2 * nbytes / seconds / 1e9, 1)
        row[f"{name}_of_ceiling"] = round(2 * nbytes / seconds / ceiling, 3)
    row["pack_speedup_vs_loop"] = round(row["pack_loop_ms"] / row["pack_ms"], 3)
    row["unpack_speedup_vs_loop"] = round(row["unpack_loop_ms"] / row["unpack_ms"], 3)
    # The timed kernels must still be right: unpacked targets equal the sources.
    unpack(pack(sources, buffer), targets)
    row["round_trip_exact"] = all(torch.equal(s, t) for s, t in zip(sources, targets, strict=True))
    return row


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write JSON; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--model", default="llama3_8b" if gpu else "tiny_llama")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15 if gpu else 5)
    parser.add_argument(
        "--chunks", type=int, nargs="*", default=[], help="extra chunk sizes (bytes) to time the kernel with"
    )
    parser.add_argument("--variants", action="store_true", help="also build and time the VARIANTS tunables")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pack.json")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])

    device = torch.device("cuda" if gpu else "cpu")
    model = model_preset(args.model)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(model.dtype, torch.float32)
    shapes = hf_parameter_shapes(model)
    loaded, why = kernel_status() if gpu else (False, "no GPU")
    backend = "fused kernel" if loaded else f"torch reference ({why})"
    ceiling = copy_ceiling(
        device, min(CEILING_BYTES, 64 << 20) if not gpu else CEILING_BYTES, args.warmup, args.repeats
    )
    variants = {}
    if gpu and loaded and args.variants:
        variants = {name: _ext.build(defines) for name, defines in VARIANTS.items()}

    rows = []
    for old_tp, new_tp, old_rank, new_rank in TRANSITIONS:
        rows.append(
            _time_transition(
                shapes, (old_tp, new_tp, old_rank, new_rank), dtype, device, ceiling, loaded, variants, args
            )
        )
        if gpu:
            torch.cuda.empty_cache()

    result = {
        "model": model.name,
        "dtype": str(dtype).replace("torch.", ""),
        "tensors_in_model": len(shapes),
        "model_bytes": sum(torch.Size(s).numel() for s in shapes.values())
        * torch.tensor([], dtype=dtype).element_size(),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "backend": backend,
        "copy_ceiling_GBps": round(ceiling / 1e9, 1),
        "repeats": args.repeats,
        "rows": rows,
    }
    _print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


def _print_table(result: dict) -> None:
    print(
        f"pack/unpack on {result['device']} ({result['model']}, {result['tensors_in_model']} tensors, "
        f"{result['model_bytes'] / 2**30:.2f} GiB {result['dtype']}); backend: {result['backend']}"
    )
    print(f"copy ceiling (read+write): {result['copy_ceiling_GBps']} GB/s")
    head = (
        f"{'TP':>6} {'tensors':>7} {'GiB':>6} | "
        f"{'pack ms':>8} {'GB/s':>7} {'%ceil':>6} {'loop ms':>8} {'x loop':>6} | "
        f"{'unpack ms':>9} {'GB/s':>7} {'%ceil':>6} {'loop ms':>8} {'x loop':>6} | exact"
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(
            f"{r['transition']:>6} {r['tensors']:>7} {r['bytes'] / 2**30:>6.2f} | "
            f"{r['pack_ms']:>8.3f} {r['pack_GBps']:>7.0f} {100 * r['pack_of_ceiling']:>5.1f}% "
            f"{r['pack_loop_ms']:>8.3f} {r['pack_speedup_vs_loop']:>6.2f} | "
            f"{r['unpack_ms']:>9.3f} {r['unpack_GBps']:>7.0f} {100 * r['unpack_of_ceiling']:>5.1f}% "
            f"{r['unpack_loop_ms']:>8.3f} "
            f"{r['unpack_speedup_vs_loop']:>6.2f} | {r['round_trip_exact']}"
        )
    extra = sorted(
        {k[: -len("_GBps")] for r in result["rows"] for k in r if k.endswith("_GBps")}
        - {"pack", "pack_loop", "unpack", "unpack_loop"}
    )
    for name in extra:
        print(
            f"  {name:>32}: "
            + "  ".join(f"{r['transition']} {100 * r[name + '_of_ceiling']:.1f}%" for r in result["rows"])
        )


if __name__ == "__main__":
    main()
