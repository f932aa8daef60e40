#!/bin/bash
# Planned first call of session 10 (nvidia-h200; carry .whl, .hilo_cache; <= 10 min): settle session 9's open question.
# Compiled GDN 340m at 8K ended 10 steps at loss 7.085 with one 512-column delta_rule call per layer, where the
# 256-column calls had given 6.689 (session 8). The one-call form is exact on CPU (fp32, interpreter, BV 16/32/64 at
# K = 256, V = 512) but its bf16 GPU tests never ran (s9_d's 100 s limit). So:
#  1. the V = 512 bf16 GPU tests (test_gpu_head_dims: test_bf16_triton_wide_value_heads), then every delta_rule /
#     loglinear_delta_rule bf16 GPU test;
#  2. GDN 340m at 8K, 10 steps, value_block 256 against 512, compiled and eager (same commit, same data): the losses
#     say whether the 512-column call (and which path) changes training; the tokens/s what it buys;
#  3. log-linear GDN's compiled decoding at 1K / 32K with more time (s9_c: past 110 s).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "V = 512 GPU tests" | tee -a $L
timeout 120 python -m pytest -p no:logging -rf tests/kernels/test_gpu_head_dims.py -k wide_value > /tmp/g0.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/g0.log | sort -u | tail -12 | cut -c1-240 >> $L
for vb in 256 512; do
  for c in "--compile" ""; do
    el "gated_deltanet 8K value_block=$vb $c" | tee -a $L
    timeout 80 python -u benchmarks/train_throughput.py --steps 10 $c --append --models gated_deltanet --seq-lens 8192 \
      model.mixer_kwargs.value_block=$vb > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| gated_deltanet " /tmp/c.log | head -1 >> $L
    grep -E "Error" /tmp/c.log | tail -2 | cut -c1-250 >> $L
  done
done
el "delta_rule GPU tests" | tee -a $L
timeout 150 python -m pytest -p no:logging -rf -n 6 tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  -k "delta_rule and not wide_value" > /tmp/g.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/g.log | sort -u | tail -8 | cut -c1-240 >> $L
left=$(( 560 - $(date +%s) + T0 )); el "compiled decoding loglinear_gated_deltanet (${left}s)" | tee -a $L
timeout $left python -u benchmarks/decode.py --contexts 1024 32768 --families loglinear_gated_deltanet --compile-decoding \
  --append > /tmp/dc.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| loglinear_gated_deltanet |^- |Error" /tmp/dc.log | sort -u | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
