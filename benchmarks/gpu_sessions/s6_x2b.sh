#!/bin/bash
# Session 6, call 2 on nvidia-h200-x2 (issue 8, part B = s5_x2b.sh): FSDP save / resume on 2 and on 1 GPU, DDP runs of
# a log-linear and an HLA model. While GPU 0 runs the one-GPU resume, GPU 1 times loglinear_delta_rule's scan and
# block-tree forms (fwd+bwd, B2 H16 D128). Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
C="model/size=340m trainer.seq_len=8192 trainer.log_every=5 trainer.val_every=0 trainer.progress_bar=false \
logger=none data.shard=rows optim.lr=1e-3 trainer.batch_size=2"
losses() { python3 -c "import json,sys; print(sys.argv[2], [round(r['train/loss'],4) for r in map(json.loads, open(sys.argv[1]+'/metrics.jsonl')) if 'train/loss' in r])" $1 $2 | tee -a $L; }
L2="python -m accelerate.commands.launch --config_file conf/accelerate/fsdp.yaml train.py model=gated_deltanet $C"
el "1. FSDP 40 steps straight, and 20 + resume to 40" | tee -a $L
timeout 90 $L2 trainer.max_steps=40 hydra.run.dir=/tmp/straight > $OUT/n/straight.log 2>&1; echo "rc=$?" >> $L; losses /tmp/straight straight
timeout 70 $L2 trainer.max_steps=20 trainer.save_every=20 hydra.run.dir=/tmp/res > $OUT/n/res1.log 2>&1; echo "rc=$?" >> $L
cp -r /tmp/res /tmp/res1gpu
timeout 70 $L2 trainer.max_steps=40 hydra.run.dir=/tmp/res > $OUT/n/res2.log 2>&1; echo "rc=$?" >> $L; losses /tmp/res resumed_2gpu
el "2. resume the step-20 checkpoint on one GPU; GPU 1: nodes vs scan" | tee -a $L
( export CUDA_VISIBLE_DEVICES=1
  for form in scan nodes; do
    HILO_LOGLINEAR_DELTA=form=$form timeout 75 python benchmarks/kernels.py --ops loglinear_delta_rule delta_rule \
      --seqlens 4096 16384 32768 --skip-check --append > $OUT/n/k_$form.log 2>&1; echo "form=$form rc=$?" >> $OUT/n/k_$form.log
  done ) &
BG=$!
CUDA_VISIBLE_DEVICES=0 timeout 80 python train.py model=gated_deltanet $C trainer.batch_size=4 trainer.max_steps=40 \
  hydra.run.dir=/tmp/res1gpu > $OUT/n/res3.log 2>&1; echo "rc=$?" >> $L; losses /tmp/res1gpu resumed_1gpu
grep -iE "resum|error" $OUT/n/res2.log $OUT/n/res3.log | tail -4 | cut -c1-250 | tee -a $L
wait $BG; for form in scan nodes; do grep -E "rc=|^\| [0-9]+ .*(delta_rule)|Error" $OUT/n/k_$form.log >> $L; done
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "3. DDP loglinear_mamba2 and hla_transformer, 20 steps" | tee -a $L
for m in loglinear_mamba2 hla_transformer; do
  timeout 80 python -m accelerate.commands.launch --config_file conf/accelerate/ddp.yaml train.py model=$m $C \
    trainer.max_steps=20 hydra.run.dir=/tmp/$m > $OUT/n/$m.log 2>&1; echo "$m rc=$?" >> $L; losses /tmp/$m $m
done
el done | tee -a $L
