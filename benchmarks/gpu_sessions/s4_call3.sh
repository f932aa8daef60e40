#!/bin/bash
# Session 4, GPU call 3: the node form with compact level lists: variants (node_lowp, node_stages) timed at 1K and
# 16K, bf16 checks with node_lowp=1, a profile of the fastest.
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. fp32 tests on CUDA" | tee -a $L
timeout 100 python -m pytest -q -x tests/kernels/test_loglinear_attn.py -k "triton or form" 2>&1 | tail -2 >> $L
el "2. variants" | tee -a $L
for var in node_lowp=0 node_lowp=1 node_lowp=1,node_stages=1 node_lowp=1,node_stages=3; do
  HILO_LOGLINEAR=$var timeout 60 python benchmarks/kernels.py --ops loglinear_attn --seqlens 1024 16384 --skip-check \
    > /tmp/k.log 2>&1; echo "$var rc=$?" >> $L; grep -E "^\| [0-9]+ .*loglinear" /tmp/k.log >> $L
done
el "3. bf16 checks with node_lowp=1" | tee -a $L
export HILO_LOGLINEAR=node_lowp=1
timeout 60 python benchmarks/kernels.py --ops loglinear_attn --skip-bench > /tmp/c.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| loglinear" /tmp/c.log >> $L
timeout 120 python -m pytest -q tests/kernels/test_gpu_bf16.py -k "loglinear_attn" 2>&1 | tail -3 >> $L
timeout 100 python -m pytest -q tests/kernels/test_gpu_head_dims.py -k "loglinear_attn" 2>&1 | tail -3 >> $L
el "4. profile 16K node_lowp=1" | tee -a $L
timeout 60 python benchmarks/kernels.py --ops loglinear_attn --seqlens 16384 --skip-check --skip-bench --profile 16384 \
  > /tmp/p.log 2>&1; echo "rc=$?" >> $L; grep -E "^ +_|elementwise|reduce|scan" /tmp/p.log | cut -c1-60,150-200 >> $L
el done | tee -a $L
cat $L
