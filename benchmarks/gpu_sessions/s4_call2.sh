#!/bin/bash
# Session 4, GPU call 2: loglinear_attn's chunk levels as a node tree (OPTIONS form="nodes", the new default) on
# the H200: fp32 and bf16 checks, timings beside the level scan (form=scan), a profile at 16K.
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. fp32 tests on CUDA" | tee -a $L
timeout 120 python -m pytest -q -x tests/kernels/test_loglinear_attn.py -k "triton or form" 2>&1 | tail -3 >> $L
el "2. bf16 tests" | tee -a $L
timeout 150 python -m pytest -q tests/kernels/test_gpu_bf16.py -k "loglinear_attn" 2>&1 | tail -3 >> $L
timeout 100 python -m pytest -q tests/kernels/test_gpu_head_dims.py -k "loglinear_attn" 2>&1 | tail -3 >> $L
el "3. timings, nodes" | tee -a $L
timeout 150 python benchmarks/kernels.py --ops loglinear_attn linear_attn --seqlens 1024 4096 8192 16384 32768 --append \
  > /tmp/k.log 2>&1; echo "rc=$?" >> $L; grep -vE "^\s*$" /tmp/k.log | tail -40 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "4. scan at 16K" | tee -a $L
HILO_LOGLINEAR=form=scan timeout 60 python benchmarks/kernels.py --ops loglinear_attn --seqlens 16384 --skip-check \
  > /tmp/k2.log 2>&1; echo "rc=$?" >> $L; grep -E "^\|" /tmp/k2.log | tail -4 >> $L
el "5. profile 16K" | tee -a $L
timeout 90 python benchmarks/kernels.py --ops loglinear_attn --seqlens 16384 --skip-check --skip-bench --profile 16384 \
  > /tmp/p.log 2>&1; echo "rc=$?" >> $L; tail -30 /tmp/p.log >> $L
el done | tee -a $L
cat $L
