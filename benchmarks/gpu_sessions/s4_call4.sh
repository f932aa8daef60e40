#!/bin/bash
# Session 4, GPU call 4: the node form with bf16 node storage (node_lowp, the default): checks, the kernel table at
# every T, a profile at 16K; then training throughput with trainer.compile: Transformer and log-linear Mamba-2 at
# 8K and 16K (issue 7's comparison). Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. tests" | tee -a $L
timeout 100 python -m pytest -q -x tests/kernels/test_loglinear_attn.py -k "triton or form" 2>&1 | tail -2 >> $L
timeout 120 python -m pytest -q tests/kernels/test_gpu_bf16.py -k "loglinear_attn" 2>&1 | tail -2 >> $L
timeout 100 python -m pytest -q tests/kernels/test_gpu_head_dims.py -k "loglinear_attn" 2>&1 | tail -2 >> $L
el "2. kernel table" | tee -a $L
timeout 120 python benchmarks/kernels.py --ops loglinear_attn --seqlens 1024 2048 4096 8192 16384 32768 --append \
  > /tmp/k.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| loglinear|^\| [0-9]+ " /tmp/k.log >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "3. profile" | tee -a $L
timeout 60 python benchmarks/kernels.py --ops loglinear_attn --seqlens 16384 --skip-check --skip-bench --profile 16384 \
  > /tmp/p.log 2>&1; echo "rc=$?" >> $L; grep -E "^ +_|elementwise|reduce|scan|Self CUDA time" /tmp/p.log | cut -c1-60,150-200 >> $L
el "4. throughput" | tee -a $L
for T in 8192 16384; do
  timeout 150 python benchmarks/train_throughput.py --steps 12 --compile --append --models transformer loglinear_mamba2 \
    --seq-lens $T > /tmp/c$T.log 2>&1; echo "rc=$? T=$T" >> $L; grep -E '^\| (transformer|loglinear)' /tmp/c$T.log >> $L
  grep -E "Error" /tmp/c$T.log | tail -2 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
