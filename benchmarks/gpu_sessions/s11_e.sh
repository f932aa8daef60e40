#!/bin/bash
# Session 11, fifth call (nvidia-h200; carry .whl, .hilo_cache; <= 5 min): compiled decoding of hla_gated_deltanet, 1K -> 32K.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
left=$(( 280 - $(date +%s) + T0 )); el "compiled decoding hla_gated_deltanet (${left}s)" | tee -a $L
timeout $left python -u benchmarks/decode.py --contexts 1024 32768 --families hla_gated_deltanet --compile-decoding \
  --append > /tmp/dc.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| hla_gated_deltanet |^- |Error" /tmp/dc.log | sort -u | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
