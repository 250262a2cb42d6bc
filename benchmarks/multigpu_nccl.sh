#!/usr/bin/env bash
# Multi-GPU validation on one host (issue 8): every visible GPU, one rank each, NCCL, NVLink multicast off.
#   bash benchmarks/multigpu_nccl.sh [N]        # N GPUs (default: all visible; 2, 4 or 8)
# 1. benchmarks/multigpu_nccl.py under torchrun: EMU checks, PPO with TP/DP changes, Extend/Merge/Split timing.
# 2. a short nereus-train run on the same GPUs (Lightning launched by torchrun; the EMU state backend).
# Logs and JSON land in $OUT.
set -u -o pipefail
OUT=${OUT:-/tmp/nereus_multigpu}
mkdir -p "$OUT"
N=${1:-$(nvidia-smi -L | wc -l)}
export PYTHONPATH=src:. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: multicast off
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpu.txt"
torchrun --standalone --nproc-per-node "$N" benchmarks/multigpu_nccl.py --out "$OUT/multigpu_nccl_$N.json" 2>&1 | tee "$OUT/multigpu_nccl_$N.log"
rc1=$?
# nereus-train on the torchrun world (Lightning sees TORCHELASTIC env and does not spawn); 12 steps, supply N -> N/2 -> N.
half=$(( N / 2 ))
counts="[$N,$N,$N,$N,$half,$half,$half,$half,$N]"
timeout 900 torchrun --standalone --nproc-per-node "$N" -m nereus_lightning.cli.train \
  trainer=gpu trainer.devices="$N" trainer.max_steps=12 cluster=h200x8 "resources.counts=$counts" \
  plot=false save_checkpoint=false hydra.run.dir="$OUT/nereus_train" 2>&1 | tail -60 | tee "$OUT/nereus_train.log"
rc2=$?
echo "multigpu_nccl.py rc=$rc1  nereus-train rc=$rc2" | tee -a "$OUT/gpu.txt"
