#!/usr/bin/env bash
# nereus GRPO against TRL's GRPOTrainer on one GPU (see benchmarks/bench_gpu_e2e.py).
# Needs the wheels the GPU image lacks in .whl/ (TRL, datasets, hydra-core, omegaconf, antlr4,
# math-verify, transformers; see the README's "One GPU" section for the download command).
# Usage: bash benchmarks/gpu_e2e.sh [shape ...]   (default: 0.5b 1.5b); results in $OUT or benchmarks/results.
# SWEEP="4 32" also runs nereus at those inference/training micro-batches on the first shape (the
# planner's choice against the fastest measured).
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
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, trl, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
runs=()
for shape in $shapes; do
  for system in nereus trl; do
    python3 benchmarks/bench_gpu_e2e.py --system "$system" --shape "$shape" --out "$results" 2>&1 | tail -40
    runs+=("$results/gpu_e2e_${system}_${shape}.json")
  done
done
first=${shapes%% *}
for mb in ${SWEEP:-}; do
  python3 benchmarks/bench_gpu_e2e.py --system nereus --shape "$first" --micro-batch "$mb" --tag "mb$mb" \
    --out "$results" 2>&1 | tail -3
  runs+=("$results/gpu_e2e_nereus_${first}_mb$mb.json")
done
python3 benchmarks/bench_gpu_e2e.py --report "${runs[@]}" | tee "$results/gpu_e2e.md"
