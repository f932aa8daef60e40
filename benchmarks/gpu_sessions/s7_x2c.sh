#!/bin/bash
# Session 7, third call (nvidia-h200-x2; carry .whl, .hilo_cache).
#  GPU 0: s7_diag_compile.py (which side of the CUDA compile test's wrong gradients is wrong, and which setting
#         removes them), then compiled decoding at 1K (python -u this time: call 1's timed-out runs left no output).
#  GPU 1: the two CUDA bf16 test files that ran past 120 s, with their slowest tests; short conv's fixed test.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
( export CUDA_VISIBLE_DEVICES=1; L1=/tmp/gpu1.txt
  for f in tests/kernels/test_short_conv.py tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py; do
    el "$f" >> $L1
    timeout 200 python -m pytest -q -p no:logging -rf --durations=5 $f -k "gpu or cuda or bf16 or custom_op or triton" > /tmp/t.log 2>&1
    echo "rc=$?" >> $L1; grep -E "passed|failed|^FAILED|s call|^E  " /tmp/t.log | tail -12 | cut -c1-200 >> $L1
  done; el "gpu1 done" >> $L1 ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
el "diag compile grads" | tee -a $L
timeout 330 python -u benchmarks/gpu_sessions/s7_diag_compile.py 2>&1 | grep -vE "Warning|warn" | tail -40 | cut -c1-330 >> $L
el "compiled decoding default, 1K" | tee -a $L
timeout 120 python -u benchmarks/decode.py --contexts 1024 --families transformer mamba2 --compile-decoding \
  > /tmp/dc.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| [a-z]|^- |Error|recompile|cudagraph" /tmp/dc.log | sort | uniq -c | tail -12 | cut -c1-250 >> $L
tail -5 /tmp/dc.log | cut -c1-250 >> $L
wait $BG; cat /tmp/gpu1.txt >> $L
el done | tee -a $L
cat $L
