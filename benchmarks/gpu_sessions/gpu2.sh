#!/bin/bash
# GPU call 2 (session 2): small-head-dim bf16 checks, kernel correctness + timings for every op, delta_rule A/B.
export WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
el "head-dim tests"
timeout 100 python -m pytest tests/kernels/test_gpu_head_dims.py -q -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error" | cut -c1-220
if ! timeout 40 python -m pytest tests/kernels/test_gpu_head_dims.py -q -k "16-16-delta_rule" -p no:cacheprovider >/dev/null 2>&1; then
  for opt in "lowp_bwd=0" "fused_bwd=0" "state_bv_min=32" "lowp_bwd=0,fused_bwd=0,prepare_mode=0,state_scale_v=0,state_bv_min=32"; do
    HILO_DELTA_RULE=$opt timeout 40 python -m pytest tests/kernels/test_gpu_head_dims.py -q -k "16-16-delta_rule" -p no:cacheprovider 2>&1 | grep -E "passed|failed|assert" | head -2 | sed "s/^/  $opt: /" | cut -c1-200
  done
fi
for op in hla2 ahla delta_rule linear_attn loglinear_attn loglinear_delta_rule; do
  el "kernels $op"
  timeout 100 python benchmarks/kernels.py --ops $op --append > $OUT/k_$op.log 2>&1; echo "rc=$?"
  grep -E "^\| " $OUT/k_$op.log | grep -vE "^\| (op|---)" | awk -F'|' '$7 ~ /no/ || NF < 8' | cut -c1-150
done
el "delta_rule variants"
timeout 70 python benchmarks/delta_rule_variants.py --variants old new new_bv32 --no-profile > $OUT/dr_variants.log 2>&1; echo "rc=$?"
tail -25 $OUT/dr_variants.log | cut -c1-200
cp benchmarks/RESULTS.md $OUT/RESULTS.md
el done
