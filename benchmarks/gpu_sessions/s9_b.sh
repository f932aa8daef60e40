#!/bin/bash
# Session 9, second call (nvidia-h200; carry .whl, .hilo_cache; <= 10 min).
#  - loglinear_delta_rule's bf16 GPU tests with grads_block=full now the default (s9_a: 53.5 against 58.5 ms).
#  - session 8's fused norms as custom ops under trainer.compile (session 7's plain-formula norms cost the compiled
#    Transformer 12% at 8K, 144,751 -> 127,090 tokens/s): compiled Transformer 2K / 8K and Mamba-2 16K with
#    --fused-norms, Mamba-2 16K without (grouped linear_attn now), and the Mamba-2 16K fused-norm step profile.
#  - log-linear GDN 340m compiled at 2 x 16K (OOM in session 8 with the chunk states kept; recomputed now).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "loglinear_delta_rule GPU tests" | tee -a $L
timeout 80 python -m pytest -p no:logging -rf -n 6 tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  -k loglinear_delta > /tmp/g1.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/g1.log | sort -u | tail -8 | cut -c1-240 >> $L
for ms in "transformer 2048 --fused-norms" "transformer 8192 --fused-norms" "mamba2 16384" "mamba2 16384 --fused-norms"; do
  set -- $ms; el "compiled $*" | tee -a $L
  timeout 70 python -u benchmarks/train_throughput.py --steps 10 --compile --append --models $1 --seq-lens $2 ${@:3} \
    > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| $1 " /tmp/c.log | head -1 >> $L
  grep -E "Error" /tmp/c.log | tail -2 | cut -c1-250 >> $L
done
el "compiled mamba2 fused-norm step profile 16K" | tee -a $L
timeout 90 python -u benchmarks/step_profile.py --families mamba2 --seq-len 16384 --compile --top 16 \
  ++model.fused_norms=true > /tmp/p.log 2>&1
echo "rc=$?" >> $L; grep -E "^###|^\| " /tmp/p.log | head -19 | cut -c1-170 >> $L
el "compiled loglinear_gated_deltanet 2 x 16K" | tee -a $L
timeout 110 python -u benchmarks/train_throughput.py --steps 8 --append --models loglinear_gated_deltanet \
  --seq-lens 16384 --batch-size 2 --compile > /tmp/c1.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| loglinear_gated_deltanet " /tmp/c1.log | head -1 >> $L
grep -E "Error|OOM" /tmp/c1.log | tail -2 | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
