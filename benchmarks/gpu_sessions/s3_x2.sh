#!/bin/bash
# Issue 8 on nvidia-h200-x2 with the session's last ~4 minutes: GDN 340m at T = 8192, the same global batch (2 rows,
# data.shard=rows) on one GPU, under DDP on two and under FSDP on two, 30 steps each; then the FSDP run resumed from
# its step-30 checkpoint for 10 more steps. Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
nvidia-smi -L | tee -a $L
C="model=gated_deltanet model/size=340m trainer.seq_len=8192 trainer.log_every=5 trainer.val_every=0 trainer.save_every=30 \
trainer.progress_bar=false logger=none data.shard=rows"
summ() { python3 - "$1" "$2" <<'PY' | tee -a $L
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in rows if "train/loss" in r]
print(sys.argv[2], "losses", [round(r["train/loss"], 4) for r in tr])
perf = [r for r in rows if "perf/tokens_per_s" in r][1:]
if perf:
    print(sys.argv[2], "tokens/s %.0f" % (sum(r["perf/tokens_per_s"] for r in perf) / len(perf)),
          "peak GiB %.2f" % max(r.get("perf/mem_peak_gib", 0) for r in perf))
PY
}
el "1. one GPU, batch 2" | tee -a $L
CUDA_VISIBLE_DEVICES=0 timeout 60 python train.py $C trainer.max_steps=30 trainer.batch_size=2 hydra.run.dir=/tmp/r1 \
  > $OUT/n/r1.log 2>&1; echo "rc=$?" | tee -a $L; summ /tmp/r1 one
el "2. DDP, 2 GPUs, batch 1 each" | tee -a $L
timeout 60 python -m accelerate.commands.launch --config_file conf/accelerate/ddp.yaml train.py $C trainer.max_steps=30 \
  trainer.batch_size=1 hydra.run.dir=/tmp/r2 > $OUT/n/r2.log 2>&1; echo "rc=$?" | tee -a $L; summ /tmp/r2 ddp
el "3. FSDP, 2 GPUs, batch 1 each" | tee -a $L
timeout 60 python -m accelerate.commands.launch --config_file conf/accelerate/fsdp.yaml train.py $C trainer.max_steps=30 \
  trainer.batch_size=1 hydra.run.dir=/tmp/r3 > $OUT/n/r3.log 2>&1; echo "rc=$?" | tee -a $L; summ /tmp/r3 fsdp
ls /tmp/r3/checkpoints 2>&1 | tee -a $L
el "4. FSDP resumed to step 40" | tee -a $L
timeout 50 python -m accelerate.commands.launch --config_file conf/accelerate/fsdp.yaml train.py $C trainer.max_steps=40 \
  trainer.batch_size=1 hydra.run.dir=/tmp/r3 > $OUT/n/r4.log 2>&1; echo "rc=$?" | tee -a $L; summ /tmp/r3 fsdp+resume
el done | tee -a $L
for f in r1 r2 r3 r4; do echo "== $f"; grep -iE "error|Traceback|resum" $OUT/n/$f.log | tail -4 | cut -c1-250; done | tee -a $L
