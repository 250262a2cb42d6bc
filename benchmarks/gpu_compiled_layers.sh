# Compiled decoder layers (algorithm.layers=compiled, the default) against the layers as written (eager), and TRL, in one
# call at 256 tokens: the GPU test of the compiled path first, then per shape in SHAPES (default
# "0.5b") nereus compiled, nereus eager and, with TRL=1, TRL. Logs go to files: inductor's compile
# workers outlive a timed-out run and would hold a pipe open.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider tests/models/test_compiled_layers.py -k "bf16 or eager_layers" \
    >"$OUT/test.log" 2>&1
grep -E "^E |passed|failed" "$OUT/test.log" | head -12
b() {
    t=$1; name=$2; shift 2
    s=$(date +%s)
    timeout -k 5 "$t" python3 benchmarks/bench_gpu_e2e.py --steps 3 --warmup 1 --out "$OUT" "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - s ))s: $(tail -c 300 "$OUT/$name.log" | tail -1)"
}
for shape in ${SHAPES:-0.5b}; do
    b "${T_AUTO:-150}" "compiled_$shape" --system nereus --shape "$shape" --new-tokens 256 --layers compiled
    b "${T_EAGER:-80}" "eager_$shape" --system nereus --shape "$shape" --new-tokens 256 --layers eager --tag eager
    [ "${TRL:-0}" = 1 ] && b "${T_TRL:-100}" "trl_$shape" --system trl --shape "$shape" --new-tokens 256
done
ls "$OUT"
