#!/usr/bin/env bash
# nereus GRPO against TRL's GRPOTrainer on one GPU over response lengths (see benchmarks/bench_gpu_e2e.py).
# Needs the wheels the GPU image lacks in .whl/ (TRL, datasets, hydra-core, omegaconf, antlr4,
# math-verify, transformers; see the README's "One GPU" section for the download command).
# Usage: bash benchmarks/gpu_e2e.sh [shape ...]   (default: 0.5b 1.5b); results in $OUT or benchmarks/results.
# LENGTHS="256 1024 2048 4096 8192": response lengths N; MAX_N_1_5B=4096: the longest N at 1.5B;
# TRL_MAX_N=2048: TRL runs up to this N (it takes ~20 s/step per 1K tokens here); STEPS: steps per run
# (the first is a warm-up). SWEEP="4 32" also runs nereus at those inference/training micro-batches on
# the first shape and length. GPU_GIB=80 caps the memory both systems may use (an H100 on an H200). REPORT_ONLY=1 only prints the table of the JSON files in the results folder.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
results=${OUT:-benchmarks/results}
shapes=${*:-0.5b 1.5b}
lengths=${LENGTHS:-256 1024 2048 4096 8192}
steps=${STEPS:-3}
if [ -z "${REPORT_ONLY:-}" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, trl, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
  for shape in $shapes; do
    for n in $lengths; do
      if [ "$shape" = 1.5b ] && [ "$n" -gt "${MAX_N_1_5B:-4096}" ]; then continue; fi
      python3 benchmarks/bench_gpu_e2e.py --system nereus --shape "$shape" --new-tokens "$n" --steps "$steps" \
        --warmup 1 --out "$results" 2>&1 | tail -4
      if [ "$n" -le "${TRL_MAX_N:-2048}" ]; then
        python3 benchmarks/bench_gpu_e2e.py --system trl --shape "$shape" --new-tokens "$n" --steps "$steps" \
          --warmup 1 --out "$results" 2>&1 | tail -3
      fi
    done
  done
  first=${shapes%% *}
  n=${lengths%% *}
  for mb in ${SWEEP:-}; do
    python3 benchmarks/bench_gpu_e2e.py --system nereus --shape "$first" --new-tokens "$n" --micro-batch "$mb" \
      --tag "mb$mb" --steps "$steps" --warmup 1 --out "$results" 2>&1 | tail -3
  done
fi
python3 benchmarks/bench_gpu_e2e.py --report "$results"/gpu_e2e_*_n*.json | tee "$results/gpu_e2e.md"
