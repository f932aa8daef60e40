#!/bin/bash
# Session 9, first call (one nvidia-h200 only was lent, so s9_x2a-c's two-GPU plan is cut to one GPU; carry .whl,
# .hilo_cache; <= 10 min). Correctness first of session 8's CPU-only work: the CUDA-only test files (grouped
# linear_attn q/k, fused norms as custom ops, loglinear_delta_rule's chunk-state recompute), the CUDA compile test
# (hla_transformer through hilo::hla_fused, +fused_norms variants), then loglinear_delta_rule at 16K: the default
# (states=recompute) and grads_block=full, and linear_attn (grouped q/k read in place) at 4K / 16K.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "CUDA-only test files" | tee -a $L
timeout 230 python -m pytest -p no:logging -rf -n 6 tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  tests/models/test_fused_norms.py tests/models/test_activation_memory.py > /tmp/g1.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/g1.log | sort -u | tail -12 | cut -c1-240 >> $L
el "CUDA compile test" | tee -a $L
timeout 170 python -m pytest -p no:logging -rf tests/training/test_compile.py -k cuda > /tmp/ct.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/ct.log | tail -10 | cut -c1-300 >> $L
for opt in "" "grads_block=full"; do
  el "kernels.py loglinear_delta_rule, HILO_LOGLINEAR_DELTA=$opt" | tee -a $L
  HILO_LOGLINEAR_DELTA=$opt timeout 60 python -u benchmarks/kernels.py --ops loglinear_delta_rule --seqlens 16384 \
    --append > /tmp/k1.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| 16384 \| 2 \| loglinear| NO \|$" /tmp/k1.log >> $L
done
el "kernels.py linear_attn" | tee -a $L
timeout 50 python -u benchmarks/kernels.py --ops linear_attn --seqlens 4096 16384 --append > /tmp/k.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| [0-9]+ \|| NO \|$" /tmp/k.log | cut -c1-200 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
