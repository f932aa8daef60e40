#!/bin/bash
# GPU call 1 (session 2): bf16 kernel checks, every model family trains on the GPU, MQAR width 32 in background.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p $OUT/mqar
T0=$(date +%s)
for m in mamba2 loglinear_mamba2 gated_deltanet loglinear_gated_deltanet hla_transformer; do
  ( s=$(date +%s); timeout -s TERM 430 python train.py experiment=mqar_sweep +model/mqar=$m model.hidden_size=32 \
      optim.lr=2.2e-3 seed=0 trainer.max_steps=3120 trainer.progress_bar=false logger=none > $OUT/mqar/$m.log 2>&1;
    echo "mqar $m rc=$? wall=$(( $(date +%s) - s ))s" >> $OUT/mqar/walls.txt ) &
done
python -m pytest tests/kernels/test_gpu_bf16.py -q -x 2>&1 | tail -8
echo "== tests done at +$(( $(date +%s) - T0 ))s"
for m in mamba2 gated_deltanet loglinear_mamba2 loglinear_gated_deltanet hla_transformer hla_mamba2 hla_gated_deltanet; do
  s=$(date +%s)
  timeout 120 python train.py model=$m model/size=340m trainer.max_steps=12 trainer.seq_len=2048 trainer.batch_size=4 \
     trainer.val_every=0 trainer.val_batches=2 trainer.save_final=false trainer.log_every=4 trainer.progress_bar=false \
     logger=none name=gpu-smoke-$m > $OUT/train_$m.log 2>&1
  echo "train $m 340m rc=$? wall=$(( $(date +%s) - s ))s :: $(grep -E 'loss' $OUT/train_$m.log | tail -1 | cut -c1-200)"
done
wait
cat $OUT/mqar/walls.txt
for d in runs/mqar/*; do n=$(basename $d); cp $d/metrics.jsonl $OUT/mqar/$n.metrics.jsonl 2>/dev/null; cp $d/summary.json $OUT/mqar/$n.summary.json 2>/dev/null; done
echo "== all done at +$(( $(date +%s) - T0 ))s"
