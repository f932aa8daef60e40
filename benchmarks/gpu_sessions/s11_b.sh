#!/bin/bash
# Planned second call of session 11 (nvidia-h200; carry .whl, .hilo_cache; <= 10 min): delta_rule's state passes with
# pipelined loads at K = 256 (HILO_DELTA_RULE=wide_stages=2, new in session 10, AOT-checked only); where Gated
# DeltaNet's step
# goes now (issue 7: GDN 340m at 8K is 0.82x the Transformer; delta_rule at its heads, H = 3, K = 256, V = 512, is
# 6.7 ms fwd+bwd per layer at 16K x 2, about half the compiled step). Compiled decoding of the HLA shells: s11_c.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "delta_rule wide_stages=2: GPU tests at K = 256, then timing at GDN 340m's heads" | tee -a $L
HILO_DELTA_RULE=wide_stages=2 timeout 100 python -m pytest -p no:logging -rf -n 4 tests/kernels/test_gpu_head_dims.py \
  -k "delta_rule and not loglinear" > /tmp/w.log 2>&1; echo "rc=$?" >> $L
grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/w.log | sort -u | tail -6 | cut -c1-240 >> $L
timeout 100 python -u benchmarks/option_sweep.py --op delta_rule --seq-len 16384 --heads 3 --dim 256 --dim-v 512 \
  --skip-check --append --variants "" "HILO_DELTA_RULE=wide_stages=2" > /tmp/o.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L
el "delta_rule profile at GDN 340m's heads" | tee -a $L
timeout 120 python -u benchmarks/kernels.py --ops delta_rule --seqlens 16384 --heads 3 --dim 256 --dim-v 512 \
  --skip-check --profile 16384 > /tmp/p.log 2>&1; echo "rc=$?" >> $L; grep -vE "^\s*$|Warn|warn" /tmp/p.log | tail -25 | cut -c1-200 >> $L
el "GDN 8K compiled step profile" | tee -a $L
timeout 150 python -u benchmarks/step_profile.py --families gated_deltanet --seq-len 8192 --compile > /tmp/s.log 2>&1
echo "rc=$?" >> $L; grep -vE "^\s*$|Warn|warn" /tmp/s.log | tail -30 | cut -c1-200 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
