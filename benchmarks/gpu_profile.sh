#!/usr/bin/env bash
# One H200: where the time goes. The static decode step's kernels (torch.profiler), the disk's write
# speed, and nereus-train's end of fit under cProfile (GRPO, 0.5B, export_hf=false). Needs the wheels
# of the README's "One GPU" section in .whl/. Output under $OUT (or /tmp/profile).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/profile}
mkdir -p "$out"
if [ -z "${SKIP_DECODE:-}" ]; then
  python3 benchmarks/gpu_decode.py --profile 16 --fp32-tokens 0 --repeats 1 2>&1 | tail -40
fi
for dir in /tmp "$PWD"; do
  start=$(date +%s.%N)
  dd if=/dev/urandom of="$dir/ddtest" bs=16M count=64 status=none conv=fsync
  echo "disk $dir: 1 GiB in $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s (urandom + fsync)"
  rm -f "$dir/ddtest"
done
python3 -m cProfile -o "$out/fit.prof" benchmarks/gpu_fit.py --algorithm "${ALGORITHM:-grpo}" \
  --out /tmp/fitout "$@" > "$out/fit.log" 2>&1
echo "fit rc=$?"; tail -8 "$out/fit.log"
python3 - "$out/fit.prof" > "$out/fit_stats.txt" <<'PY'
import pstats, sys
s = pstats.Stats(sys.argv[1])
s.sort_stats("cumulative").print_stats(
    r"save_checkpoint|save_state|save_tensors|dcp|nonfinite|on_train_end|teardown|write_back|barrier|"
    r"_teardown|destroy|export|summarize|print_summary|_run_train|fit_loop|on_train_batch_end|_offload|onload")
s.sort_stats("tottime").print_stats(25)
PY
head -c 7000 "$out/fit_stats.txt"
