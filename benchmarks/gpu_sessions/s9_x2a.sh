#!/bin/bash
# Planned first call of session 9 (nvidia-h200-x2; carry .whl, .hilo_cache; <= 10 min). Only log.txt, log1.txt and
# RESULTS.md come back.
#  GPU 0: session 8's linear_attn change (grouped q, k read in place, no repeat copies; one fp32-accumulating sum of
#         a group's dq, dk), written on the CPU: its bf16 GPU tests (incl. the new grouped test), kernels.py's check
#         and time, then compiled Mamba-2 340m at 8K / 16K (session 8: 104,075 / 102,243 tokens/s) and its 16K step
#         profile (were 98 ATen elementwise and 75 copy kernels per step, 47 ms, gone?).
#         Also (GPU 0) kernels.py loglinear_delta_rule with the chunk-state recompute (the default), states=save and
#         grads_block=full (the split backward's gradient kernel in one K-block at K = 128: half its products, one
#         program an SM instead of two; kernels.py checks each in bf16 before timing it).
#  GPU 1: every other CUDA-only test (regressions; loglinear_delta_rule now recomputes its chunk states in the
#         backward); then log-linear GDN 340m (OOM at 4 x 8K and 2 x 16K in session 8, when the states were kept)
#         compiled at 4 x 8K and 2 x 16K, and eager at 1 x 8K with 4 accumulated (compiled, that ran at 1,680
#         tokens/s: is compile the cause?).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt; L1=$OUT/n/log1.txt
( export CUDA_VISIBLE_DEVICES=1
  el "CUDA-only tests" >> $L1
  timeout 200 python -m pytest -p no:logging -rf -n 8 tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
    > /tmp/g1.log 2>&1; echo "rc=$?" >> $L1; grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/g1.log | sort -u | tail -10 | cut -c1-220 >> $L1
  for spec in "8192 4 1 --compile" "16384 2 1 --compile" "8192 1 4"; do
    set -- $spec; el "loglinear_gated_deltanet $1 ${2}x$3 ${@:4}" >> $L1
    timeout 100 python -u benchmarks/train_throughput.py --steps 8 --append --models loglinear_gated_deltanet \
      --seq-lens $1 --batch-size $2 trainer.grad_accum=$3 "${@:4}" > /tmp/c1.log 2>&1
    echo "rc=$?" >> $L1; grep -E "^\| loglinear_gated_deltanet " /tmp/c1.log | head -1 >> $L1
    grep -E "Error|OOM" /tmp/c1.log | tail -2 | cut -c1-250 >> $L1
  done ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
el "linear_attn GPU tests" | tee -a $L
timeout 120 python -m pytest -p no:logging -rf -n 4 tests/kernels/test_gpu_bf16.py tests/models \
  -k "(linear_attn and not loglinear) or (mamba2 and (cuda or gpu or bf16))" > /tmp/t.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/t.log | sort -u | tail -8 | cut -c1-220 >> $L
for opt in "" "states=save" "grads_block=full"; do
  el "kernels.py loglinear_delta_rule, HILO_LOGLINEAR_DELTA=$opt" | tee -a $L
  HILO_LOGLINEAR_DELTA=$opt timeout 70 python -u benchmarks/kernels.py --ops loglinear_delta_rule --seqlens 16384 \
    --append > /tmp/k1.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| 16384 \| 2 \| loglinear| NO \|$" /tmp/k1.log >> $L
done
el "kernels.py linear_attn" | tee -a $L
timeout 60 python -u benchmarks/kernels.py --ops linear_attn --seqlens 4096 16384 --append > /tmp/k.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| [0-9]+ \|| NO \|$" /tmp/k.log | cut -c1-200 >> $L
for T in 8192 16384; do
  el "compiled mamba2 $T" | tee -a $L
  timeout 70 python -u benchmarks/train_throughput.py --steps 10 --compile --append --models mamba2 --seq-lens $T \
    > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| mamba2 " /tmp/c.log | head -1 >> $L
done
el "compiled mamba2 step profile 16K" | tee -a $L
timeout 90 python -u benchmarks/step_profile.py --families mamba2 --seq-len 16384 --compile --top 16 > /tmp/p.log 2>&1
echo "rc=$?" >> $L; grep -E "^###|^\| " /tmp/p.log | head -19 | cut -c1-170 >> $L
wait $BG; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L $L1
