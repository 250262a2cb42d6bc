#!/usr/bin/env bash
# One H200: where the time goes. The static decode step's kernels (torch.profiler), the disk's write
# speed, and when nereus-train's end-of-fit phases ran (GRPO, 0.5B, export_hf=false). Needs the wheels
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
python3 benchmarks/gpu_fit.py --algorithm "${ALGORITHM:-grpo}" --out /tmp/fitout --phases "$@" > "$out/fit.log" 2>&1
echo "fit rc=$?"; grep -E "fit_s|last_step_to_fit_end|timing_s/step" "$out/fit.log"; sed -n '/^phases after/,$p' "$out/fit.log"
