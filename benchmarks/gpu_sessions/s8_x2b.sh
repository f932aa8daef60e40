#!/bin/bash
# Planned second call of session 8 (nvidia-h200-x2; carry .whl, .hilo_cache; <= 10 min): every CUDA-only test.
# Session 7 found them bound by Triton's compilation (each head-dim pair compiles its own kernels: 8 of 24 and 30 of
# 64 tests ran in 140 s / 100 s), so they run under pytest-xdist (its wheel is in .whl): compilation is host work
# and parallelises over the 32 cores while the processes share each GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
( CUDA_VISIBLE_DEVICES=1 timeout 500 python -m pytest -p no:logging -rf -n 8 tests/kernels/test_gpu_head_dims.py \
    > /tmp/g1.log 2>&1; echo "head_dims rc=$?" >> /tmp/g1.log ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
el "test_gpu_bf16" | tee -a $L
timeout 250 python -m pytest -p no:logging -rf -n 8 tests/kernels/test_gpu_bf16.py > /tmp/g0.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/g0.log | tail -12 | cut -c1-250 >> $L
el "other CUDA tests" | tee -a $L
timeout 230 python -m pytest -p no:logging -rf -n 8 tests/kernels tests/models tests/training \
  --ignore=tests/kernels/test_gpu_head_dims.py --ignore=tests/kernels/test_gpu_bf16.py -k "gpu or cuda or bf16 or custom_op" \
  > /tmp/g2.log 2>&1; echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/g2.log | tail -15 | cut -c1-250 >> $L
wait $BG; el "head dims (GPU 1)" >> $L; grep -E "passed|failed|^FAILED|^E  |rc=" /tmp/g1.log | tail -12 | cut -c1-250 >> $L
el done | tee -a $L
cat $L
