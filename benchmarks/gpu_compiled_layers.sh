# Whole-stack compiled layers against the layers as written and TRL, one call (SHAPE, default 0.5b; 256 tokens).
# Logs go to files: inductor's compile workers outlive a timed-out run and would hold a pipe open.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
b() {
    t=$1; name=$2; shift 2
    s=$(date +%s)
    timeout -k 5 "$t" python3 benchmarks/bench_gpu_e2e.py --steps 3 --warmup 1 --out "$OUT" "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - s ))s: $(tail -c 300 "$OUT/$name.log" | tail -1)"
}
b "${T_AUTO:-220}" auto_${SHAPE:-0.5b} --system nereus --shape ${SHAPE:-0.5b} --new-tokens 256
b "${T_EAGER:-110}" eager_${SHAPE:-0.5b} --system nereus --shape ${SHAPE:-0.5b} --new-tokens 256 --layers eager --tag eager
b "${T_TRL:-100}" trl_${SHAPE:-0.5b} --system trl --shape ${SHAPE:-0.5b} --new-tokens 256
ls "$OUT"
