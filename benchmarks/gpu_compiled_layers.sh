set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/models/test_compiled_layers.py -k "bf16 or eager_layers" 2>&1 | grep -E "^E |passed|failed" | head -12
b() { t=$1; shift; timeout $t python3 benchmarks/bench_gpu_e2e.py --steps 3 --warmup 1 --out $OUT "$@" 2>&1 | tail -1; }
b 100 --system nereus --shape 0.5b --new-tokens 256
b 70 --system nereus --shape 0.5b --new-tokens 256 --layers eager --tag eager
b 70 --system trl --shape 0.5b --new-tokens 256
b 110 --system nereus --shape 1.5b --new-tokens 256
b 80 --system nereus --shape 1.5b --new-tokens 256 --layers eager --tag eager
ls $OUT
