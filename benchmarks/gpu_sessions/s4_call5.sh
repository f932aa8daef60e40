#!/bin/bash
# Session 4, GPU call 5: loglinear_attn node_save (bf16 checks, 16K timing), then compiled training throughput of
# the linear families not yet measured compiled (issue 7). Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. node_save" | tee -a $L
HILO_LOGLINEAR=node_save=1 timeout 100 python -m pytest -q tests/kernels/test_gpu_bf16.py -k "loglinear_attn and long" 2>&1 | tail -1 >> $L
for var in node_save=0 node_save=1; do
  HILO_LOGLINEAR=$var timeout 50 python benchmarks/kernels.py --ops loglinear_attn --seqlens 4096 16384 --skip-check \
    > /tmp/k.log 2>&1; echo "$var rc=$?" >> $L; grep -E "^\| [0-9]+ .*loglinear" /tmp/k.log >> $L
done
el "2. compiled throughput" | tee -a $L
for spec in "gated_deltanet:8192" "mamba2:16384" "hla_transformer:8192" "gated_deltanet:16384"; do
  m=${spec%:*}; T=${spec#*:}
  timeout 110 python benchmarks/train_throughput.py --steps 12 --compile --append --models $m --seq-lens $T \
    > /tmp/c.log 2>&1; echo "rc=$? $m $T" >> $L; grep -E "^\| $m " /tmp/c.log >> $L; grep -E "Error" /tmp/c.log | tail -1 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
