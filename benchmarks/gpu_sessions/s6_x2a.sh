#!/bin/bash
# Session 6, call 1 on nvidia-h200-x2 (issue 8, part A = s5_x2a.sh) with the GPU-only tests on GPU 1 meanwhile:
# while GPU 0 runs the one-GPU loss references, GPU 1 runs every CUDA-only test (the 90 that CI skips: session 5's
# custom ops and short conv kernels among them) and the bf16 checks of loglinear_delta_rule's block-tree form; they
# end before the two-GPU runs start. Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
nvidia-smi -L | tee -a $L
( export CUDA_VISIBLE_DEVICES=1
  timeout 170 python -m pytest -q -rf tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
    tests/kernels/test_short_conv.py tests/kernels/test_linear_attn.py tests/kernels/test_delta_rule.py \
    tests/kernels/test_hla.py tests/kernels/test_loglinear_attn.py tests/kernels/test_loglinear_delta_rule.py \
    tests/models/test_fused_norms.py tests/models/test_activation_memory.py -k "gpu or cuda or bf16 or custom_op" \
    > $OUT/n/gputests.log 2>&1; echo "gpu tests rc=$?" >> $OUT/n/gputests.log
  HILO_LOGLINEAR_DELTA=form=nodes timeout 60 python -m pytest -q -rf tests/kernels/test_gpu_bf16.py \
    -k loglinear_delta_rule > $OUT/n/nodes_bf16.log 2>&1; echo "nodes bf16 rc=$?" >> $OUT/n/nodes_bf16.log ) &
BG=$!
C="model=gated_deltanet model/size=340m trainer.seq_len=8192 trainer.log_every=5 trainer.val_every=0 \
trainer.progress_bar=false trainer.save_final=false logger=none data.shard=rows optim.lr=1e-3 trainer.data_hashes=true"
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
one() {  # name, batch, steps
  CUDA_VISIBLE_DEVICES=0 timeout 100 python train.py $C trainer.max_steps=$3 trainer.batch_size=$2 \
    hydra.run.dir=/tmp/$1 > $OUT/n/$1.log 2>&1; echo "$1 rc=$?" | tee -a $L; summ /tmp/$1 $1
}
two() {  # name, accelerate config
  timeout 110 python -m accelerate.commands.launch --config_file conf/accelerate/$2.yaml train.py $C \
    trainer.max_steps=50 trainer.batch_size=2 hydra.run.dir=/tmp/$1 > $OUT/n/$1.log 2>&1
  echo "$1 rc=$?" | tee -a $L; summ /tmp/$1 $1; python -m training.data_hashes /tmp/$1 | tee -a $L
}
el "1. one GPU, 4 rows, twice" | tee -a $L; one one_a 4 50; one one_b 4 50
el "waiting for GPU 1's tests" | tee -a $L; wait $BG; tail -4 $OUT/n/gputests.log $OUT/n/nodes_bf16.log >> $L
el "2. DDP" | tee -a $L; two ddp ddp
el "3. FSDP" | tee -a $L; two fsdp fsdp
el "4. one GPU, 2 rows (per-GPU throughput reference)" | tee -a $L; one one_2 2 20
el done | tee -a $L
for f in one_a ddp fsdp; do echo "== $f"; grep -iE "error|Traceback|warn" $OUT/n/$f.log | tail -3 | cut -c1-250; done | tee -a $L
