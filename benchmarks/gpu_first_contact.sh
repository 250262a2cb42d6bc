#!/usr/bin/env bash
# First contact on one GPU (issue 33): a user's model folder, prompts and reward with `nereus-train
# trainer=gpu` and no cluster setting must run and print the GPU it has (its topology line); then the
# same job with no trainer setting (a folder on a CUDA machine takes the GPUs itself) and the probe's
# GPU tests. Run on one H100 and on one H200: `bash benchmarks/gpu_first_contact.sh`. Needs the
# hydra-core, omegaconf and antlr4 wheels in .whl/ (README "One GPU"); writes under $OUT (/tmp/first).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
job=${OUT:-/tmp/first}
mkdir -p "$job"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"
python3 - "$job" <<'PY'
import sys
from tests.helpers import word_problem_job

job = word_problem_job(sys.argv[1], vocab_size=300)  # a tiny Qwen2 folder with its tokenizer, parquet prompts
open(f"{sys.argv[1]}/reward.py", "w").write(
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return float(str(ground_truth) in solution_str)\n"
)
PY
user=(actor.path="$job/model" data.train_files="$job/train.parquet" custom_reward_function.path="$job/reward.py"
      data.max_response_length=16 trainer.max_steps=2 export_hf=false)
python3 -m nereus_lightning.cli.train trainer=gpu "${user[@]}" hydra.run.dir="$job/gpu" 2>&1 | tee "$job/gpu.log"
python3 -m nereus_lightning.cli.train "${user[@]}" hydra.run.dir="$job/default" 2>&1 | tee "$job/default.log"
for run in gpu default; do
  grep -F "topology" "$job/$run.log" | grep -F "(${gpu}" || { echo "FAILED: $run printed no topology of $gpu"; exit 1; }
done
python3 -m pytest -q -s -p no:cacheprovider tests/lightning/test_devices_gpu.py
echo "first contact: OK on $gpu"
