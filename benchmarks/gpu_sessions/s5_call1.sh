#!/bin/bash
# Planned first one-GPU call of the next session (nvidia-h200), for what session 4 built without device time:
# loglinear_attn node_grads_split (bf16 check, timing), Mamba-2 with B/C per group (compiled throughput and peak
# memory at 8K / 16K: before, 86,785 tok/s / 59.90 GiB and 88,407 / 59.90), fused norms in decoding and training,
# compiled decoding (model.compile_decoding; eager: 27-60 ms per token at 340m). Over 10 minutes: split it.
# Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. node_grads_split" | tee -a $L
HILO_LOGLINEAR=node_grads_split=1 timeout 100 python -m pytest -q tests/kernels/test_gpu_bf16.py -k "loglinear_attn" 2>&1 | tail -1 >> $L
for var in node_grads_split=0 node_grads_split=1 node_grads_split=1,node_save=1; do
  HILO_LOGLINEAR=$var timeout 50 python benchmarks/kernels.py --ops loglinear_attn --seqlens 4096 16384 --skip-check \
    > /tmp/k.log 2>&1; echo "$var rc=$?" >> $L; grep -E "^\| [0-9]+ .*loglinear" /tmp/k.log >> $L
done
el "2. mamba2 compiled, B/C per group" | tee -a $L
timeout 200 python benchmarks/train_throughput.py --steps 12 --compile --append --models mamba2 --seq-lens 8192 16384 \
  > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| mamba2" /tmp/c.log >> $L; grep Error /tmp/c.log | tail -1 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "3. decode with fused norms" | tee -a $L
timeout 90 python benchmarks/decode.py --contexts 1024 --families transformer mamba2 model.fused_norms=true \
  > /tmp/d.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| (transformer|mamba2)" /tmp/d.log >> $L
el "4. training with fused norms (uncompiled)" | tee -a $L
timeout 150 python benchmarks/train_throughput.py --steps 12 --fused-norms --append --models transformer mamba2 \
  --seq-lens 8192 > /tmp/f.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| (transformer|mamba2)" /tmp/f.log >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "5. compiled decoding (default mode, then reduce-overhead: CUDA graphs)" | tee -a $L
for mode in "" reduce-overhead; do
  timeout 150 python benchmarks/decode.py --contexts 1024 32768 --families transformer mamba2 hla_transformer \
    loglinear_mamba2 --compile-decoding $mode --append > /tmp/dc.log 2>&1; echo "compile ${mode:-default} rc=$?" >> $L
  grep -E "^\| [a-z]|^- " /tmp/dc.log >> $L; grep -E "Error" /tmp/dc.log | tail -2 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
