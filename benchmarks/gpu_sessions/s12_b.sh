#!/bin/bash
# Planned second call of session 12 (nvidia-h200; carry .whl, .hilo_cache; <= 10 min): where Gated DeltaNet's step
# goes (issue 7: GDN 340m at 8K is 0.82x the Transformer, 104,571 against 127,090 tokens/s; a 258 ms step against
# 313): delta_rule's kernels at its heads (H = 3, K = 256, V = 512, 6.40 ms fwd+bwd per layer at 16K x 2 with the
# two-stage state passes, about half the step), then the compiled step's kernels.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "delta_rule's fused backward launch at GDN 340m's heads (182 registers at 8 warps: one program an SM)" | tee -a $L
timeout -k 20 150 python -u benchmarks/option_sweep.py --op delta_rule --seq-len 16384 --heads 3 --dim 256 --dim-v 512 \
  --skip-check --append --variants "" "HILO_DELTA_RULE=grads_maxnreg=128" "HILO_DELTA_RULE=grads_warps=4" \
  "HILO_DELTA_RULE=grads_stages=3" > /tmp/o.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "delta_rule profile at GDN 340m's heads" | tee -a $L
timeout -k 20 150 python -u benchmarks/kernels.py --ops delta_rule --seqlens 16384 --heads 3 --dim 256 --dim-v 512 \
  --skip-check --profile 16384 > /tmp/p.log 2>&1; echo "rc=$?" >> $L; grep -vE "^\s*$|Warn|warn" /tmp/p.log | tail -25 | cut -c1-200 >> $L
el "GDN 8K compiled step profile" | tee -a $L
timeout -k 20 230 python -u benchmarks/step_profile.py --families gated_deltanet --seq-len 8192 --compile > /tmp/s.log 2>&1
echo "rc=$?" >> $L; grep -vE "^\s*$|Warn|warn" /tmp/s.log | tail -40 | cut -c1-200 >> $L
el done | tee -a $L
cat $L
