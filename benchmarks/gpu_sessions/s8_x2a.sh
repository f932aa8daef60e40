#!/bin/bash
# Planned first call of session 8 (nvidia-h200-x2; carry .whl, .hilo_cache; <= 10 min). Only log.txt and
# RESULTS.md come back (more than 8 files under $OUT are not returned).
#  GPU 0: the CUDA compile test after session 7's norm fix, every family (log-linear Mamba-2's A_log / dt_bias
#         now judged against fp32); then compiled training throughput with the fixed norms (mamba2 at 8K and 16K,
#         gated_deltanet at 8K, transformer at 2K, 8K, 16K: issue 7's comparisons), then where a compiled Mamba-2 step's time
#         goes (step_profile --compile, 8K).
#  GPU 1: issue 7's 760m at 16K with a 0.5M-token batch (32 x 1 row accumulated), transformer and mamba2, then
#         compiled decoding of mamba2 at 1K and 32K (its compile took ~3 min in session 7; python -u: that session's
#         timed-out runs left no output).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt; L1=/tmp/gpu1.txt
( export CUDA_VISIBLE_DEVICES=1
  for m in transformer mamba2; do
    el "760m 16K 32x1 $m" >> $L1
    timeout 120 python -u benchmarks/train_throughput.py --sizes 760m --seq-lens 16384 --batch-size 1 --steps 3 \
      --compile --models $m trainer.grad_accum=32 > /tmp/b_$m.log 2>&1
    echo "rc=$?" >> $L1; grep -E "^\| $m " /tmp/b_$m.log >> $L1; grep -E "Error|OOM" /tmp/b_$m.log | tail -2 | cut -c1-250 >> $L1
  done
  el "compiled decoding 1K 32K" >> $L1
  timeout 230 python -u benchmarks/decode.py --contexts 1024 32768 --families mamba2 \
    --compile-decoding > /tmp/dc.log 2>&1; echo "rc=$?" >> $L1
  grep -E "^\| [a-z]|^- |Error" /tmp/dc.log | sort -u | cut -c1-250 >> $L1 ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
el "CUDA compile test" | tee -a $L
timeout 150 python -m pytest -p no:logging -rf tests/training/test_compile.py -k cuda > /tmp/ct.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/ct.log | tail -10 | cut -c1-300 >> $L
for ms in "mamba2 8192" "gated_deltanet 8192" "transformer 2048" "transformer 8192" "mamba2 16384" "transformer 16384"; do
  set -- $ms; el "compiled $1 $2" | tee -a $L
  timeout 65 python -u benchmarks/train_throughput.py --steps 10 --compile --append --models $1 --seq-lens $2 \
    > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| $1 " /tmp/c.log >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el "compiled mamba2 step profile 8K" | tee -a $L
timeout 100 python -u benchmarks/step_profile.py --families mamba2 --seq-len 8192 --compile --top 20 > /tmp/p.log 2>&1
echo "rc=$?" >> $L; tail -30 /tmp/p.log | cut -c1-200 >> $L
wait $BG; cat $L1 >> $L
el done | tee -a $L
cat $L
