#!/bin/bash
# Planned for the next session (nvidia-h200): issue 7's "760m at 16,384 trains in the GPU's memory with a
# 0.5M-token global batch via accumulation": one row of 16,384 tokens per micro step, 32 micro steps per optimizer
# step (524,288 tokens), 3 steps per family, compiled blocks. tokens/s counts all 32 micro steps; the table's batch
# column reads 1x32 (rows per micro step x micro steps). Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
for m in transformer mamba2 gated_deltanet loglinear_mamba2 hla_transformer; do
  el "$m" | tee -a $L
  timeout 110 python benchmarks/train_throughput.py --sizes 760m --seq-lens 16384 --batch-size 1 --steps 3 --compile \
    --append --models $m trainer.grad_accum=32 > /tmp/$m.log 2>&1
  echo "$m rc=$?" >> $L; grep -E "^\| $m " /tmp/$m.log >> $L; grep -E "Error|OOM" /tmp/$m.log | tail -1 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
