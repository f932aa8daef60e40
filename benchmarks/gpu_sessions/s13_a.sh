#!/bin/bash
# Planned first call of session 13 (nvidia-h200; carry .whl; <= 9 min): session 12 made HLA's chunk kernels 4 warps
# with 128-wide K loops and delta_rule's fused backward 4 warps / 3 stages the defaults; test_gpu_head_dims passed
# under each setting alone, but test_hla.py and test_delta_rule.py never finished on the GPU under them (s12_e.sh
# saw a block of failures that looked like a sticky CUDA fault in one worker; s12_g.sh hit its time limit). Here the
# GPU-running tests of both files, each file in its own pytest run (4 workers), its whole log kept under $OUT, the
# slowest tests listed; then the head-dim and bf16 GPU tests of both operators under the defaults.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
run() {  # name, seconds, pytest arguments
  el "$1" | tee -a $L
  timeout -k 10 $2 python -m pytest -p no:logging -n 4 -v --tb=short --durations=8 "${@:3}" > $OUT/n/$1.txt 2>&1
  echo "rc=$?" >> $L; grep -E "^E  |FAILED|ERROR|[0-9]+ passed|[0-9]+ failed|^[0-9.]+s " $OUT/n/$1.txt | head -30 | cut -c1-250 >> $L
  echo "PASSED lines: $(grep -c " PASSED " $OUT/n/$1.txt)" >> $L
}
# first the suspect alone: test_fused_launch_tiles (session 11, never run on a GPU before s12_e.sh) sets every HLA tile
# to 16, and Triton 3.6 has faulted at narrow tiles on Hopper before (linear_attn at K = 32, V = 16; session 11's
# [256, 16] level scan): a fault there would explain s12_e.sh's block of failures in one worker
el "launch_tiles alone, CUDA_LAUNCH_BLOCKING=1" | tee -a $L
CUDA_LAUNCH_BLOCKING=1 timeout -k 10 60 python -m pytest -p no:logging -p no:xdist --tb=short tests/kernels/test_hla.py \
  -k "launch_tiles" > $OUT/n/launch_tiles.txt 2>&1; echo "rc=$?" >> $L
grep -E "^E  |^FAILED|passed|failed" $OUT/n/launch_tiles.txt | head -12 | cut -c1-250 >> $L
run delta_rule_tests 120 tests/kernels/test_delta_rule.py
run hla_fused_tests 240 tests/kernels/test_hla.py -k "fused or triton"
run head_dims 90 tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py -k "hla2 or ahla or (delta_rule and not loglinear)"
el done | tee -a $L
cat $L
