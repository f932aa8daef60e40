#!/bin/bash
# Session 11, fourth call (nvidia-h200; carry .whl, .hilo_cache; <= 6 min): delta_rule's GPU head-dim tests with
# the two-stage default (s11_c2.sh's 100 s ran out), then compiled decoding of hla_mamba2, 1K -> 32K.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "delta_rule GPU head-dim tests (wide_stages default 2)" | tee -a $L
timeout 170 python -m pytest -p no:logging -rf -n 4 tests/kernels/test_gpu_head_dims.py \
  -k "delta_rule and not loglinear" > /tmp/w.log 2>&1; echo "rc=$?" >> $L
grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/w.log | sort -u | tail -6 | cut -c1-240 >> $L
left=$(( 370 - $(date +%s) + T0 )); el "compiled decoding hla_mamba2 (${left}s)" | tee -a $L
timeout $left python -u benchmarks/decode.py --contexts 1024 32768 --families hla_mamba2 --compile-decoding \
  --append > /tmp/dc.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| hla_mamba2 |^- |Error" /tmp/dc.log | sort -u | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
