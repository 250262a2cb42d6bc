#!/usr/bin/env bash
# One device-tool call on the GPU machine: build the fused pack/unpack kernels, run the kernel
# tests (GPU bit-exact + CPU reference), then the benchmark. Logs and JSON land in $OUT.
#   bash benchmarks/gpu_check.sh [extra bench_pack.py args]
set -u -o pipefail
OUT=${OUT:-/tmp/nereus_gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
# The tunable variant builds in the background while the default builds and the tests run.
python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from bench_pack import VARIANTS; from nereus_lightning.kernels import _ext
for d in VARIANTS.values(): _ext.build(d)" > "$OUT/variants_build.log" 2>&1 &
variants=$!
start=$(date +%s)
python3 -c "from nereus_lightning.kernels import _ext; _ext.build(verbose=True); print('built')" > "$OUT/build.log" 2>&1; tail -40 "$OUT/build.log"
echo "build seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/build.log"
python3 -m pytest -q -p no:cacheprovider tests/kernels -k "not hipify" -rs > "$OUT/pytest.log" 2>&1; tail -60 "$OUT/pytest.log"
wait $variants; echo "variants build rc=$?" | tee -a "$OUT/variants_build.log"
python3 benchmarks/bench_pack.py --out "$OUT/pack_h200.json" "$@" 2>&1 | tee "$OUT/bench.log"
