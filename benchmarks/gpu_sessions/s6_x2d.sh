#!/bin/bash
# Session 6, call 4 on nvidia-h200-x2: the fixes for what call 3 found in compiled training (torch 2.11 could not
# trace torch.amp.is_autocast_available: a graph break and recompilations in every block; linear_attn_backward's dg
# strides differed from its fake; inductor could not lower a searchsorted over a slice in GDN's chunk table).
# GPU 0: the CUDA compile test, then compiled mamba2 / gated_deltanet throughput. GPU 1: every CUDA-only test (call 1
# ran out of time after 170 s with no failure), then compiled decoding. Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
( export CUDA_VISIBLE_DEVICES=1; L1=$OUT/n/gpu1.txt
  el "gpu tests" >> $L1
  timeout 230 python -m pytest -q -rf --durations=6 tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
    tests/kernels/test_short_conv.py tests/kernels/test_linear_attn.py tests/kernels/test_delta_rule.py \
    tests/kernels/test_hla.py tests/kernels/test_loglinear_attn.py tests/kernels/test_loglinear_delta_rule.py \
    tests/models/test_fused_norms.py tests/models/test_activation_memory.py -k "gpu or cuda or bf16 or custom_op" \
    > $OUT/n/gputests.log 2>&1; echo "gpu tests rc=$?" >> $L1; tail -14 $OUT/n/gputests.log >> $L1
  el "compiled decoding" >> $L1
  timeout 110 python benchmarks/decode.py --contexts 1024 32768 --families transformer mamba2 hla_transformer \
    --compile-decoding --append > $OUT/n/dc.log 2>&1; echo "rc=$?" >> $L1
  grep -E "^\| [a-z]|^- " $OUT/n/dc.log >> $L1; grep -iE "Error|recompile_limit|does not know" $OUT/n/dc.log | sort | uniq -c | tail -4 | cut -c1-250 >> $L1
  el "gpu1 done" >> $L1 ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
el "CUDA compile test" | tee -a $L
timeout 170 python -m pytest -q -rf tests/training/test_compile.py -k cuda > $OUT/n/ct.log 2>&1; echo "rc=$?" >> $L
grep -E "passed|failed|^FAILED|Error" $OUT/n/ct.log | tail -8 | cut -c1-300 >> $L
for m in mamba2 gated_deltanet; do
  el "compiled $m" | tee -a $L
  timeout 100 python benchmarks/train_throughput.py --steps 10 --compile --append --models $m --seq-lens 8192 16384 \
    > $OUT/n/c_$m.log 2>&1; echo "$m rc=$?" >> $L; grep -E "^\| $m " $OUT/n/c_$m.log >> $L
  grep -E "Error|recompile_limit|does not know" $OUT/n/c_$m.log | sort | uniq -c | tail -3 | cut -c1-250 >> $L
done
wait $BG; cat $OUT/n/gpu1.txt >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
