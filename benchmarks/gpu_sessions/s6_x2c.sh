#!/bin/bash
# Session 6, call 3 on nvidia-h200-x2: one-GPU measurements, two at a time (one per GPU; separate GPUs, 32 cores).
# GPU 0: compiled decoding (session 5's whole-buffer KV steps; default and reduce-overhead), the Transformer at 2K
# compiled (issue 7's MFU target), a profile of loglinear_delta_rule's block-tree form at 16K.
# GPU 1: compiled training throughput of mamba2 and gated_deltanet at 8K / 16K with session 4-5's shells (short conv
# Triton custom op, B/C per group), then the short conv kernels against ATen. Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
( export CUDA_VISIBLE_DEVICES=1; L1=$OUT/n/gpu1.txt
  for m in mamba2 gated_deltanet; do
    el "compiled $m" >> $L1
    timeout 140 python benchmarks/train_throughput.py --steps 12 --compile --append --models $m --seq-lens 8192 16384 \
      > $OUT/n/c_$m.log 2>&1; echo "$m rc=$?" >> $L1; grep -E "^\| $m " $OUT/n/c_$m.log >> $L1; grep -E "Error" $OUT/n/c_$m.log | tail -1 >> $L1
  done
  el "short conv" >> $L1
  timeout 80 python benchmarks/short_conv.py --append > $OUT/n/sc.log 2>&1; echo "rc=$?" >> $L1
  grep -E "NO|^\| [0-9]+ " $OUT/n/sc.log >> $L1; grep -E "Error" $OUT/n/sc.log | tail -2 >> $L1; el "gpu1 done" >> $L1 ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
for mode in "" reduce-overhead; do
  el "compiled decoding ${mode:-default}" | tee -a $L
  timeout 120 python benchmarks/decode.py --contexts 1024 32768 --families transformer mamba2 hla_transformer \
    loglinear_mamba2 --compile-decoding $mode --append > $OUT/n/dc${mode}.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| [a-z]|^- " $OUT/n/dc${mode}.log >> $L
  grep -iE "Error|skipping cudagraphs|re-record" $OUT/n/dc${mode}.log | sort | uniq -c | tail -6 >> $L
done
el "transformer 2K compiled" | tee -a $L
timeout 110 python benchmarks/train_throughput.py --steps 16 --compile --append --models transformer --seq-lens 2048 \
  > $OUT/n/t2k.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| transformer" $OUT/n/t2k.log >> $L; grep Error $OUT/n/t2k.log | tail -1 >> $L
el "profile nodes 16K" | tee -a $L
HILO_LOGLINEAR_DELTA=form=nodes timeout 50 python benchmarks/kernels.py --ops loglinear_delta_rule --skip-check \
  --skip-bench --profile 16384 > $OUT/n/prof.log 2>&1; echo "profile rc=$?" >> $L; tail -25 $OUT/n/prof.log >> $L
wait $BG; cat $OUT/n/gpu1.txt >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
