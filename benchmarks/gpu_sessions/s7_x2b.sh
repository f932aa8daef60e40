#!/bin/bash
# Planned second call of session 7 on nvidia-h200-x2 (issue 8's last runs; carry .whl, .hilo_cache): FSDP with
# hilo's precision policy (fp32 reduction and gathers, autocast entered by the loop; session 6's try computed in
# fp32 because accelerate gives FSDP2 models no autocast), its loss against the one-GPU runs of session 6 (batch 4:
# 5.0522 at step 50; 2 x 2 accumulation = DDP: 5.1030), per-GPU throughput against 40,939 tokens/s (one GPU, 2
# rows), peak memory against DDP's 33.57 GiB; the bf16-gather option; the FSDP step-20 checkpoint resumed on one GPU
# (the new cross-layout load) and the row stream continuing.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
C="model=gated_deltanet model/size=340m trainer.seq_len=8192 trainer.log_every=5 trainer.val_every=0 \
trainer.progress_bar=false trainer.save_final=false logger=none data.shard=rows optim.lr=1e-3"
FS="python -m accelerate.commands.launch --config_file conf/accelerate/fsdp.yaml train.py"
summ() { python benchmarks/run_summary.py "$1" "$2" | tee -a $L; }
el "1. FSDP (fp32 gathers), 2 x 2 rows, 50 steps, checkpoint at 20" | tee -a $L
timeout 120 $FS $C trainer.max_steps=50 trainer.batch_size=2 trainer.save_every=20 hydra.run.dir=/tmp/fsdp \
  > $OUT/n/fsdp.log 2>&1; echo "rc=$?" >> $L; summ /tmp/fsdp fsdp_fp32
el "2. FSDP, bf16 gathers, 50 steps" | tee -a $L
timeout 110 $FS $C trainer.max_steps=50 trainer.batch_size=2 trainer.fsdp_param_dtype=bf16 hydra.run.dir=/tmp/fsdp16 \
  > $OUT/n/fsdp16.log 2>&1; echo "rc=$?" >> $L; summ /tmp/fsdp16 fsdp_bf16
el "3. the FSDP step-20 checkpoint on one GPU, 4 rows, to step 50" | tee -a $L
CUDA_VISIBLE_DEVICES=0 timeout 100 python train.py $C trainer.max_steps=50 trainer.batch_size=4 \
  trainer.resume=/tmp/fsdp/checkpoints/step_00000020 hydra.run.dir=/tmp/f2one > $OUT/n/f2one.log 2>&1
echo "rc=$?" >> $L; summ /tmp/f2one fsdp_to_one_gpu; grep -E "resumed|restarts|holds|Error" $OUT/n/f2one.log | sort -u | cut -c1-300 | tee -a $L
el done | tee -a $L
cat $L
