#!/bin/bash
# Session 10, call 2 (nvidia-h200; carry .whl, .hilo_cache): s10_a found compiled GDN 340m at 8K ending 10 steps at
# loss 7.10 / 7.09 with value_block 256 / 512, eager at 6.82 / 6.69: the value block is not what moved the loss;
# compiling, or session 9's 64x64 short conv tiles, may be. So: gradients at training shapes against fp32 eager
# (s10_diag_grads.py), the short conv's bf16 GPU tests, then the compiled 10-step run again (is it deterministic?)
# and with ATen's conv (HILO_SHORT_CONV=torch) and the old tiles (HILO_SHORT_CONV_TILES=32x64w4).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "gradients at training shapes" | tee -a $L
timeout 200 python -u benchmarks/gpu_sessions/s10_diag_grads.py > /tmp/d.log 2>&1; echo "rc=$?" >> $L
grep -vE "^\s*$|Warning|warn" /tmp/d.log | tail -20 | cut -c1-300 >> $L
el "short conv GPU tests" | tee -a $L
timeout 60 python -m pytest -p no:logging -rf tests/kernels/test_short_conv.py -k gpu > /tmp/s.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/s.log | tail -6 | cut -c1-240 >> $L
for env in "X=1" "X=1" "HILO_SHORT_CONV=torch" "HILO_SHORT_CONV_TILES=32x64w4"; do
  left=$(( 570 - $(date +%s) + T0 )); [ $left -lt 50 ] && break
  el "gated_deltanet 8K compiled $env" | tee -a $L
  env $env timeout $left python -u benchmarks/train_throughput.py --steps 10 --compile --models gated_deltanet \
    --seq-lens 8192 > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| gated_deltanet " /tmp/c.log | head -1 >> $L
  grep -E "Error" /tmp/c.log | tail -2 | cut -c1-250 >> $L
done
el done | tee -a $L
cat $L
