#!/bin/bash
# Session 6, call 5 on nvidia-h200-x2 (issue 8, after call 1-2's findings): FSDP with hilo's precision policy (fp32
# gradient reduction, fp32 parameter gathers; accelerate's default reduced in bf16 and drifted from one GPU), and
# checkpoints across layouts and world sizes: the FSDP step-20 checkpoint resumed on one GPU, a one-GPU step-20
# checkpoint resumed under FSDP on two, both continuing the same row stream (data.shard=rows). GPU 1 meanwhile: the
# one-GPU run at the same global batch by accumulation (2 x 2 rows: the summation-order noise floor) and the reason
# for the CUDA compile test's graph break. Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
C="model=gated_deltanet model/size=340m trainer.seq_len=8192 trainer.log_every=5 trainer.val_every=0 \
trainer.progress_bar=false trainer.save_final=false logger=none data.shard=rows optim.lr=1e-3"
FS="python -m accelerate.commands.launch --config_file conf/accelerate/fsdp.yaml train.py"
summ() { python3 - "$1" "$2" <<'PY' | tee -a $L
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in rows if "train/loss" in r]
print(sys.argv[2], "steps", [r.get("step") for r in tr][:1], "losses", [round(r["train/loss"], 4) for r in tr])
perf = [r for r in rows if "perf/tokens_per_s" in r][1:]
if perf:
    print(sys.argv[2], "tokens/s %.0f" % (sum(r["perf/tokens_per_s"] for r in perf) / len(perf)),
          "peak GiB %.2f" % max(r.get("perf/mem_peak_gib", 0) for r in perf))
PY
}
el "a. FSDP, 2 GPUs x 2 rows, 50 steps, checkpoints at 20 and 40" | tee -a $L
timeout 110 $FS $C trainer.max_steps=50 trainer.batch_size=2 trainer.save_every=20 hydra.run.dir=/tmp/fsdp \
  > $OUT/n/fsdp.log 2>&1; echo "rc=$?" >> $L; summ /tmp/fsdp fsdp
( export CUDA_VISIBLE_DEVICES=1
  timeout 95 python train.py $C trainer.max_steps=50 trainer.batch_size=2 trainer.grad_accum=2 trainer.save_every=20 \
    hydra.run.dir=/tmp/acc > $OUT/n/acc.log 2>&1; echo "acc rc=$?" > $OUT/n/gpu1.txt
  TORCH_LOGS=graph_breaks timeout 70 python -m pytest -q -x tests/training/test_compile.py -k "cuda and mamba2" \
    > $OUT/n/ct.log 2>&1; echo "compile test rc=$?" >> $OUT/n/gpu1.txt ) &
BG=$!
el "b. the FSDP step-20 checkpoint resumed on one GPU (4 rows)" | tee -a $L
CUDA_VISIBLE_DEVICES=0 timeout 90 python train.py $C trainer.max_steps=50 trainer.batch_size=4 \
  trainer.resume=/tmp/fsdp/checkpoints/step_00000020 hydra.run.dir=/tmp/f2one > $OUT/n/f2one.log 2>&1
echo "rc=$?" >> $L; summ /tmp/f2one fsdp_to_one; grep -E "resumed|restarts|layout|Error" $OUT/n/f2one.log | cut -c1-300 | tee -a $L
wait $BG; cat $OUT/n/gpu1.txt >> $L; summ /tmp/acc one_gpu_accum
grep -iE "graph break|Graph Break|Reason|skipped|user code|File \"/work" $OUT/n/ct.log | head -30 | cut -c1-300 >> $L
grep -E "passed|failed" $OUT/n/ct.log | tail -1 >> $L
el "c. the one-GPU step-20 checkpoint resumed under FSDP on 2 GPUs" | tee -a $L
timeout 90 $FS $C trainer.max_steps=40 trainer.batch_size=2 trainer.resume=/tmp/acc/checkpoints/step_00000020 \
  hydra.run.dir=/tmp/one2f > $OUT/n/one2f.log 2>&1; echo "rc=$?" >> $L; summ /tmp/one2f one_to_fsdp
grep -E "resumed|restarts|layout|Error" $OUT/n/one2f.log | sort | uniq | cut -c1-300 | tee -a $L
el done | tee -a $L
cat $L
