#!/bin/bash
# Planned third call of session 11 (nvidia-h200; carry .whl, .hilo_cache; <= 7 min): compiled decoding of the two HLA
# shells, 1K -> 32K (issue 7's decode table has them eager only; log-linear GDN's compiled run took about 160 s).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
for fam in hla_mamba2 hla_gated_deltanet; do
  left=$(( 400 - $(date +%s) + T0 )); [ $left -lt 60 ] && break
  el "compiled decoding $fam (${left}s)" | tee -a $L
  timeout $(( left > 250 ? 200 : left )) python -u benchmarks/decode.py --contexts 1024 32768 \
    --families $fam --compile-decoding --append > /tmp/dc.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| $fam |^- |Error" /tmp/dc.log | sort -u | cut -c1-250 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
