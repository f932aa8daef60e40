#!/bin/bash
# Planned second one-GPU call of session 6 (nvidia-h200): compiled training throughput of the recurrent families
# with what sessions 4-5 changed in their shells without device time: the short conv's Triton kernels (one custom-op
# node in the compiled graph instead of ATen's conv1d), Mamba-2's B/C per group (-15.5 KiB/token/layer on CPU), and
# the timing fix. Before (session 4, compiled, inflated by the timing bug): mamba2 86.8K / 88.4K tok/s at 8K / 16K,
# gated_deltanet 63.0K / 62.5K, loglinear_mamba2 66.3K / 65.4K; Transformer 153.6K / 111.0K. Then decoding and
# training with the Triton norms (model.fused_norms, uncompiled). Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
for m in mamba2 gated_deltanet transformer; do
  el "compiled $m" | tee -a $L
  timeout 150 python benchmarks/train_throughput.py --steps 12 --compile --append --models $m --seq-lens 8192 16384 \
    > /tmp/c.log 2>&1; echo "$m rc=$?" >> $L; grep -E "^\| $m " /tmp/c.log >> $L; grep -E "Error" /tmp/c.log | tail -1 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el "where a compiled mamba2 step goes" | tee -a $L
timeout 120 python benchmarks/step_profile.py --families mamba2 --compile --top 25 > /tmp/sp.log 2>&1
echo "rc=$?" >> $L; grep -A28 "^### mamba2" /tmp/sp.log >> $L
el "decode with fused norms" | tee -a $L
timeout 90 python benchmarks/decode.py --contexts 1024 --families transformer mamba2 model.fused_norms=true \
  > /tmp/d.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| (transformer|mamba2)" /tmp/d.log >> $L
el done | tee -a $L
cat $L
