#!/bin/bash
# Session 3, GPU call 5 (<= 4.5 min, the budget's rest): training throughput with trainer.compile (Transformer 2K,
# Mamba-2 8K), decoding at 1K / 32K after the decode-step fixes, and 340m smoke runs of the presets not yet trained
# on the GPU (hla3_transformer, hla_mamba2 and log-linear GDN at 8K tokens per step). Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. smoke runs (parallel, small batches)" | tee -a $L
i=0
for m in hla3_transformer hla_mamba2 loglinear_gated_deltanet; do
  i=$((i+1))
  (timeout 85 python train.py model=$m model/size=340m trainer.max_steps=8 trainer.seq_len=2048 trainer.batch_size=4 \
    trainer.val_every=0 trainer.save_final=false trainer.log_every=4 trainer.progress_bar=false logger=none \
    name=smoke$i > /tmp/t$i.log 2>&1; echo "train $m rc=$? :: $(grep -E "step +8|Error|error" /tmp/t$i.log | tail -2 | cut -c1-200)" >> $L) &
done
wait
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "2. throughput with compile" | tee -a $L
timeout 90 python benchmarks/train_throughput.py --steps 16 --compile --append --models transformer --seq-lens 2048 \
  > /tmp/c1.log 2>&1; echo "rc=$?" >> $L; grep -E '^\| transformer' /tmp/c1.log >> $L; grep -E "Error" /tmp/c1.log | tail -2 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "3. decode" | tee -a $L
timeout 55 python benchmarks/decode.py --contexts 1024 32768 --families mamba2 hla_transformer transformer --append \
  > /tmp/d.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |^- " /tmp/d.log >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "4. mamba2 compile" | tee -a $L
timeout 90 python benchmarks/train_throughput.py --steps 16 --compile --append --models mamba2 --seq-lens 8192 \
  > /tmp/c2.log 2>&1; echo "rc=$?" >> $L; grep -E '^\| mamba2' /tmp/c2.log >> $L; grep -E "Error" /tmp/c2.log | tail -2 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
