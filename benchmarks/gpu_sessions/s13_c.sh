#!/bin/bash
# Planned third call of session 13 (nvidia-h200; carry .whl; <= 10 min): training throughput under session 12's kernel
# defaults (delta_rule's fused backward 4 warps / 3 stages: about a sixth off _grads_kernel, 19% of GDN's 8K step;
# HLA's chunk kernels 4 warps, 128-wide K loops: hla2 -28%), then model.fused_projections (session 11, CPU-tested,
# from s12_d.sh, unrun). Against session 11's 104,571 (GDN 8K), 184,940 (Transformer 2K) tokens/s; HLA families at
# 8K 0.41-0.50x the Transformer's 127,090 (hla_mamba2 52,237: its hla2 at H = 32, K = 128, V = 64 went 17.2 -> 12.2 ms).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
for spec in "gated_deltanet 8192 -" "gated_deltanet 8192 --fused-projections" "hla_mamba2 8192 -" \
            "transformer 2048 --fused-projections"; do
  set -- $spec; extra=$3; [ "$3" = "-" ] && extra=""
  left=$(( 560 - $(date +%s) + T0 )); [ $left -lt 90 ] && break
  el "$1 at $2, compiled $extra (${left}s)" | tee -a $L
  timeout -k 20 $(( left > 200 ? 200 : left )) python -u benchmarks/train_throughput.py --steps 12 --compile \
    --append $extra --models $1 --seq-lens $2 > /tmp/f.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| $1 " /tmp/f.log | head -1 >> $L; grep -E "Error" /tmp/f.log | tail -2 | cut -c1-250 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
