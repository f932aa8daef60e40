#!/bin/bash
# Session 7, fourth call (nvidia-h200-x2; carry .whl, .hilo_cache): call 3 found the compiled blocks' gradients wrong
# on the GPU with aot_eager in fp32 too (not inductor, not autocast; right on the CPU with torch 2.13). GPU 0: each of
# hilo's autograd.Functions alone under compile, then the whole model with each replaced by its plain formula.
# GPU 1: the two CUDA bf16 test files that ran past 200 s, verbose, to see which tests are slow.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
( export CUDA_VISIBLE_DEVICES=1
  timeout 140 python -m pytest -v -p no:logging tests/kernels/test_gpu_bf16.py -k "gpu or cuda or bf16" > /tmp/b.log 2>&1
  timeout 100 python -m pytest -v -p no:logging tests/kernels/test_gpu_head_dims.py > /tmp/h.log 2>&1 ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
el "autograd.Functions alone" | tee -a $L
timeout 100 python -u benchmarks/gpu_sessions/s7_diag_functions.py 2>&1 | grep -vE "Warning|warn" | tail -12 | cut -c1-300 >> $L
el "whole model, plain formulas" | tee -a $L
timeout 140 python -u benchmarks/gpu_sessions/s7_diag_compile.py 2>&1 | grep -vE "Warning|warn" | tail -20 | cut -c1-420 >> $L
wait $BG
el "gpu1" >> $L; grep -E "PASSED|FAILED|ERROR" /tmp/b.log | tail -30 | cut -c1-160 >> $L; tail -3 /tmp/b.log | cut -c1-200 >> $L
grep -E "PASSED|FAILED|ERROR" /tmp/h.log | tail -12 | cut -c1-160 >> $L; tail -3 /tmp/h.log | cut -c1-200 >> $L
el done | tee -a $L
cat $L
