#!/bin/bash
# Planned first GPU call of the next session (<= 9 min; then next2.sh): everything built since the last GPU check, correctness
# first, then timings. Run from the repository root; carry .whl (offline wheelhouse) and .hilo_cache.
# Each pytest case runs in its own process: a CUDA illegal access poisons every later test of its process.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. GPU tests, one process per case (16 at a time)" | tee -a $L
python -m pytest tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py --collect-only -o addopts="" -q \
  -p no:cacheprovider 2>/dev/null | grep "::" > /tmp/ids.txt
wc -l < /tmp/ids.txt | tee -a $L
cat /tmp/ids.txt | xargs -P 16 -I{} sh -c 'timeout 120 python -m pytest "{}" -o addopts="" -q -p no:cacheprovider \
  > /tmp/one.$$.log 2>&1 && echo "PASS {}" || echo "FAIL {} :: $(grep -E "^E " /tmp/one.$$.log | head -2 | tr "\n" " " | cut -c1-200)"' \
  | sed 's#tests/kernels/##' | sort >> $L
grep -c PASS $L; grep FAIL $L
el "2. kernel checks + timings, one op per process" | tee -a $L
for op in hla2 ahla loglinear_delta_rule loglinear_attn delta_rule linear_attn; do
  timeout 80 python benchmarks/kernels.py --ops $op --append > $OUT/n/k_$op.log 2>&1; echo "$op rc=$?" | tee -a $L
  grep -E "^\| " $OUT/n/k_$op.log | grep -vE "sdpa|^\| (op|T) |---" | awk -F'|' 'NF==8 && $7 !~ /yes/ || NF==7' >> $L
done
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
tail -60 $L
