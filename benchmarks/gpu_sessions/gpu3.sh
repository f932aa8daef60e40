#!/bin/bash
# GPU call 3 (session 2): phase 1 in parallel (correctness only: per-case head-dim probes, kernel checks, MQAR
# mamba2); phase 2 alone (timings).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/p
( timeout 110 python train.py experiment=mqar_sweep +model/mqar=mamba2 model.hidden_size=32 optim.lr=2.2e-3 seed=0 \
    trainer.max_steps=1560 trainer.val_every=390 trainer.progress_bar=false logger=none > $OUT/p/mqar_mamba2.log 2>&1;
  echo "mqar rc=$? wall=$(( $(date +%s) - T0 ))s" > $OUT/p/mqar_rc.txt ) &
ids=$(python -m pytest tests/kernels/test_gpu_head_dims.py --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::")
for id in $ids; do
  ( timeout 90 python -m pytest "$id" -q -p no:cacheprovider > /tmp/hd_$(echo $id | md5sum | cut -c1-8).log 2>&1 \
    && echo "PASS $id" || echo "FAIL $id :: $(grep -E '^E ' /tmp/hd_$(echo $id | md5sum | cut -c1-8).log | head -1 | cut -c1-160)" ) >> $OUT/p/headdims.txt &
done
timeout 110 python benchmarks/kernels.py --ops hla2 ahla loglinear_attn loglinear_delta_rule --skip-bench > $OUT/p/checks.log 2>&1; echo "checks rc=$?"
grep -E "^\| " $OUT/p/checks.log | awk -F'|' '$7 ~ /no/' | cut -c1-150; grep -E "Error" $OUT/p/checks.log | head -3 | cut -c1-200
wait
cp runs/mqar/mamba2-d32-lr0.0022-s0/metrics.jsonl $OUT/p/mqar_metrics.jsonl 2>/dev/null
el "phase 1 done"; sort $OUT/p/headdims.txt | sed 's/tests.kernels.test_gpu_head_dims.py:://' ; cat $OUT/p/mqar_rc.txt
grep -h '"val/mqar_acc"' runs/mqar/mamba2-d32-lr0.0022-s0/metrics.jsonl 2>/dev/null | cut -c1-260 | tail -4
for op in hla2 loglinear_attn loglinear_delta_rule; do
  el "timing $op"; timeout 45 python benchmarks/kernels.py --ops $op --skip-check --seqlens 1024 4096 16384 32768 --append >> $OUT/p/timing.log 2>&1; echo "rc=$?"
  cp benchmarks/RESULTS.md $OUT/p/RESULTS.md
done
cp benchmarks/RESULTS.md $OUT/p/RESULTS.md; cp runs/mqar/mamba2-d32-lr0.0022-s0/metrics.jsonl $OUT/p/mqar_metrics.jsonl 2>/dev/null
el done
