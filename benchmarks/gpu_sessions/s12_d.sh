#!/bin/bash
# Planned for session 12 if device time allows (nvidia-h200; carry .whl, .hilo_cache; <= 8 min): model.fused_projections
# (session 11, CPU-tested: the projections of one layer input as one matmul of stacked weights; the same products and
# parameters, one read of the input and one input gradient instead of one per projection). Gated DeltaNet has six
# such projections (two of them 3 columns wide), the Transformer three. Against session 11's 104,571 (GDN 8K) and
# 184,940 / 187,179 (Transformer 2K, default / max-autotune) tokens/s.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
for spec in "gated_deltanet 8192" "transformer 2048"; do
  set -- $spec
  left=$(( 450 - $(date +%s) + T0 )); [ $left -lt 60 ] && break
  el "$1 at $2, compiled, --fused-projections (${left}s)" | tee -a $L
  timeout -k 20 $(( left > 220 ? 220 : left )) python -u benchmarks/train_throughput.py --steps 12 --compile \
    --append --fused-projections --models $1 --seq-lens $2 > /tmp/f.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| $1 " /tmp/f.log | head -1 >> $L; grep -E "Error" /tmp/f.log | tail -2 | cut -c1-250 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
