#!/bin/bash
# Session 11, last call (nvidia-h200; carry .whl, .hilo_cache; <= 230 s of device time left): HILO_HLA=fp16=1, the
# fused HLA kernels' products on power-of-two-scaled fp16 operands (tf32's 11 significant bits at the 16-bit
# tensor-core rate; AOT sm_90: no spills, 41-65 KB of shared memory against 33-70): the narrow-head bf16 tests on
# real fp16 dots (K = 32, V = 64, where lowp=1's bf16 dots failed on the H200), then hla2 / ahla checked and timed.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "fp16 operand tests on the GPU" | tee -a $L
timeout 70 python -m pytest -p no:logging -rf -s tests/kernels/test_hla.py -k "fp16_operands or lowp_scan" \
  > /tmp/t.log 2>&1; echo "rc=$?" >> $L
grep -E "passed|failed|^FAILED|^(hla2|ahla|\.hla2|\.ahla) " /tmp/t.log | cut -c1-330 >> $L
for op in hla2 ahla; do
  left=$(( 190 - $(date +%s) + T0 )); [ $left -lt 25 ] && break
  el "$op 16K: defaults vs fp16=1 (${left}s)" | tee -a $L
  timeout $left python -u benchmarks/option_sweep.py --op $op --seq-len 16384 --append --variants "" \
    "HILO_HLA=fp16=1" > /tmp/o.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
