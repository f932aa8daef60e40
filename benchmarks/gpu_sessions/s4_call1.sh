#!/bin/bash
# Session 4, GPU call 1: 340m smoke runs at 8K tokens per step of the presets not yet trained on the GPU
# (hla3_transformer, ahla_transformer, hla_mamba2, loglinear_gated_deltanet), training throughput with and without
# trainer.compile (Transformer 2K, Mamba-2 8K), decoding at 1K / 32K after the decode-step fixes.
# Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
smoke() {  # model, index
  timeout 80 python train.py model=$1 model/size=340m trainer.max_steps=6 trainer.seq_len=8192 trainer.batch_size=1 \
    trainer.val_every=0 trainer.save_final=false trainer.log_every=2 trainer.progress_bar=false logger=none \
    name=smoke$2 > /tmp/t$2.log 2>&1
  echo "train $1 rc=$? :: $(grep -E "step +6|Error|error" /tmp/t$2.log | tail -2 | cut -c1-220)" >> $L
}
el "1. smoke runs, two at a time" | tee -a $L
smoke hla3_transformer 1 & smoke ahla_transformer 2 & wait
smoke hla_mamba2 3 & smoke loglinear_gated_deltanet 4 & wait
nvidia-smi --query-gpu=memory.used --format=csv >> $L
el "2. transformer 2K without / with compile" | tee -a $L
for c in "" --compile; do
  timeout 150 python benchmarks/train_throughput.py --steps 16 $c --append --models transformer --seq-lens 2048 \
    > /tmp/c1.log 2>&1; echo "rc=$? $c" >> $L; grep -E '^\| transformer' /tmp/c1.log >> $L; grep -E "Error" /tmp/c1.log | tail -2 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el "3. decode" | tee -a $L
timeout 60 python benchmarks/decode.py --contexts 1024 32768 --families mamba2 hla_transformer transformer --append \
  > /tmp/d.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |^- " /tmp/d.log >> $L; grep Error /tmp/d.log | tail -2 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "4. mamba2 8K compile" | tee -a $L
timeout 150 python benchmarks/train_throughput.py --steps 16 --compile --append --models mamba2 --seq-lens 8192 \
  > /tmp/c2.log 2>&1; echo "rc=$?" >> $L; grep -E '^\| mamba2' /tmp/c2.log >> $L; grep -E "Error" /tmp/c2.log | tail -2 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
