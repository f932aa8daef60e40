#!/bin/bash
# Session 9, third call (nvidia-h200; carry .whl, .hilo_cache; <= 10 min).
#  - log-linear GDN 340m trained at 10,780 tokens/s compiled (s9_b; GDN 83,933): loglinear_delta_rule and delta_rule
#    timed and profiled at that model's shape (H = 3, K = 256, V = 512, 16K x 2).
#  - compiled decoding at 1K and 32K (issue 7's and 4's latency ratios) of gated_deltanet, loglinear_mamba2,
#    loglinear_gated_deltanet and transformer, one family per process.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "kernels.py at GDN 340m's shape" | tee -a $L
timeout 120 python -u benchmarks/kernels.py --ops delta_rule loglinear_delta_rule --seqlens 16384 --heads 3 --dim 256 \
  --dim-v 512 --skip-check --profile 16384 --append > /tmp/k.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| 16384|Error" /tmp/k.log >> $L; grep -A20 "wall" /tmp/k.log | cut -c1-230 | head -48 >> $L
for fam in loglinear_gated_deltanet gated_deltanet loglinear_mamba2 transformer; do
  el "compiled decoding $fam 1K 32K" | tee -a $L
  timeout 110 python -u benchmarks/decode.py --contexts 1024 32768 --families $fam --compile-decoding --append \
    > /tmp/dc.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| $fam |^- |Error" /tmp/dc.log | sort -u | cut -c1-250 >> $L
done
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
