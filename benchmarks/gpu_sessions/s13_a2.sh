#!/bin/bash
# Session 13, second call (nvidia-h200; carry .whl; <= 9 min). s13_a.sh ran out of time in every pytest run (its
# 60-240 s limits were too short for the GPU's Triton compiles) and lost its failure details: the pyproject's "-q"
# cancelled "-v", and timeout's SIGTERM killed pytest before its summary. test_delta_rule.py showed two F's in 31.
# Here: addopts cleared (-v works), timeouts send SIGINT first (pytest prints the failures it has), and the
# delta_rule and HLA files run side by side (6 workers each on the 16 cores), every log kept whole under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
run() {  # name, seconds, workers, pytest arguments
  el "start $1" >> $L
  timeout -s INT -k 30 $2 python -m pytest -o addopts="" -p no:logging -n $3 -v -ra --tb=short --durations=10 \
    "${@:4}" > $OUT/n/$1.txt 2>&1
  echo "$1 rc=$?" >> $L; el "end $1" >> $L
}
( run delta_rule_tests 300 6 tests/kernels/test_delta_rule.py
  run head_dims 200 6 tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py \
    -k "hla2 or ahla or (delta_rule and not loglinear)" ) &
run hla_fused_tests 500 7 tests/kernels/test_hla.py -k "fused or triton"
wait
el done >> $L
for f in $OUT/n/*_tests.txt $OUT/n/head_dims.txt; do echo "== $f"; grep -E "FAILED|ERROR|^E  |passed|failed|Interrupt" $f | head -40 | cut -c1-300; done
cat $L
