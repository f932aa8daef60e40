#!/bin/bash
# Planned first one-GPU call of session 6 (nvidia-h200), for what sessions 4-5 built without device time, most
# valuable first (each step appends to RESULTS.md, copied to $OUT after each). Carry .whl, .hilo_cache.
#  1. loglinear_delta_rule, chunk levels as a block tree (HILO_LOGLINEAR_DELTA=form=nodes, session 5): the bf16 GPU
#     checks, then fwd+bwd time against the scan (65 ms at 16K, B2 H16 D128) and a profile of the nodes form.
#  2. compiled decoding (session 5: a step reads whole preallocated KV buffers with a key mask, so no shape follows
#     the position and CUDA graphs can replay): default mode and reduce-overhead, 1K and 32K contexts.
#  3. Transformer 340m at 2K, compiled, with session 4's timing fix (issue 7's 45% MFU target).
#  (1d: the short conv's Triton kernels against ATen's conv1d, bf16 checks and times.)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "0. session 5's custom ops (linear_attn, delta_rule, short_conv) on the GPU: bf16 checks, compiled one-graph tests" | tee -a $L
timeout 150 python -m pytest -q -x tests/kernels/test_gpu_bf16.py tests/kernels/test_short_conv.py \
  tests/kernels/test_linear_attn.py tests/kernels/test_delta_rule.py -k "gpu or custom_op or bf16" 2>&1 | tail -3 >> $L
el "1a. nodes: bf16 checks" | tee -a $L
HILO_LOGLINEAR_DELTA=form=nodes timeout 150 python -m pytest -q tests/kernels/test_gpu_bf16.py -k loglinear_delta_rule \
  2>&1 | tail -2 >> $L
el "1b. nodes vs scan, fwd+bwd" | tee -a $L
for form in scan nodes; do
  HILO_LOGLINEAR_DELTA=form=$form timeout 80 python benchmarks/kernels.py --ops loglinear_delta_rule delta_rule \
    --seqlens 4096 16384 32768 --skip-check --append > /tmp/k.log 2>&1; echo "form=$form rc=$?" >> $L
  grep -E "^\| [0-9]+ .*(delta_rule)" /tmp/k.log >> $L; grep -E "Error" /tmp/k.log | tail -2 >> $L
done
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
HILO_LOGLINEAR_DELTA=form=nodes timeout 60 python benchmarks/kernels.py --ops loglinear_delta_rule --skip-check \
  --skip-bench --profile 16384 > /tmp/p.log 2>&1; echo "profile rc=$?" >> $L; tail -25 /tmp/p.log >> $L
el "1c. loglinear_attn profile at 4K (7.46 ms vs cuDNN 4.00; nearly flat from 1K to 16K: what does not scale?)" | tee -a $L
timeout 60 python benchmarks/kernels.py --ops loglinear_attn --skip-check --skip-bench --profile 4096 > /tmp/p4.log 2>&1
echo "profile 4K rc=$?" >> $L; tail -25 /tmp/p4.log >> $L
el "1d. short conv: Triton kernels (session 5) against ATen's conv1d" | tee -a $L
timeout 90 python benchmarks/short_conv.py --append > /tmp/sc.log 2>&1; echo "rc=$?" >> $L
grep -E "NO|^\| [0-9]+ " /tmp/sc.log >> $L; grep -E "Error" /tmp/sc.log | tail -2 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "1e. hla2 / ahla fused with bf16 dot operands (HILO_HLA=lowp=1, session 5; default tf32: 10.3-12 ms at 16K)" | tee -a $L
for opt in lowp=0 lowp=1; do
  HILO_HLA=$opt timeout 100 python benchmarks/kernels.py --ops hla2 ahla --seqlens 4096 16384 --append > /tmp/h.log 2>&1
  echo "HILO_HLA=$opt rc=$?" >> $L; grep -E "NO|^\| [0-9]+ .*(hla2|ahla)" /tmp/h.log | head -20 >> $L
done
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "2. compiled decoding" | tee -a $L
for mode in "" reduce-overhead; do
  timeout 130 python benchmarks/decode.py --contexts 1024 32768 --families transformer mamba2 hla_transformer \
    loglinear_mamba2 --compile-decoding $mode --append > /tmp/dc.log 2>&1; echo "compile ${mode:-default} rc=$?" >> $L
  grep -E "^\| [a-z]|^- " /tmp/dc.log >> $L; grep -iE "Error|skipping cudagraphs|re-record" /tmp/dc.log | sort | uniq -c | tail -6 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el "3. transformer 2K compiled" | tee -a $L
timeout 120 python benchmarks/train_throughput.py --steps 16 --compile --append --models transformer --seq-lens 2048 \
  > /tmp/t.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| transformer" /tmp/t.log >> $L; grep Error /tmp/t.log | tail -1 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
