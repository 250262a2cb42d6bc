#!/usr/bin/env bash
# One H200: nereus-train with PPO and GRPO on a 0.5B Qwen2 folder (bf16, trainer.devices=1), and the
# GPU-only offload test. Arguments are nereus-train overrides (e.g. export_hf=false). Needs
# hydra-core, omegaconf and antlr4 wheels in .whl/ (README "One GPU").
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
results=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for alg in ${ALGORITHMS:-grpo ppo}; do
  python3 benchmarks/gpu_fit.py --algorithm "$alg" --out "$results" "$@" > "$results/gpu_fit_$alg.log" 2>&1
  rc=$?
  exit_at=$(date +%s.%N)
  tail -40 "$results/gpu_fit_$alg.log"
  python3 -c "import json,sys; r=json.load(open('$results/gpu_fit_$alg/result.json')); print('$alg rc=$rc last step -> process exit', round($exit_at - r['last_step_end'], 2), 's')" || echo "$alg rc=$rc (no result)"
done
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/lightning/test_offload_gpu.py 2>&1 | tail -5
