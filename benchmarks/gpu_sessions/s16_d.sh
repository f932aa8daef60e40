#!/bin/bash
# Session 16, third call (nvidia-h200; carry .whl; <= 9.5 min). s16_a / s16_b measured state_segments slower
# everywhere, most at few programs where the walk should shorten most (32K x 1, H = 4: fwd+bwd 1.49 -> 2.81 ms with
# the rule's 12 segments). Per-kernel profiles, segments off and on, say whether the Triton launches or the torch ops
# around them (segment_gate_sums) take the time. Then the GPU tests at the session's fix (2656932: the unsegmented
# state kernels failed to compile after caa9f72).
source benchmarks/gpu_sessions/lib.sh
for spec in "32768 4 1" "32768 4 0" "16384 16 1" "16384 16 0"; do
  set -- $spec
  el "profile linear_attn T=$1 H=$2 state_segments=$3"
  HILO_LINEAR_ATTN=state_segments=$3 timeout -s INT -k 10 60 python -u benchmarks/kernels.py --ops linear_attn \
    --skip-check --skip-bench --heads $2 --profile $1 > "$OUT/n/prof_$1_$2_$3.log" 2>&1
  echo "rc=$?" >> "$L"; grep -E "wall|_chunk|aten|Name|cumsum|index" "$OUT/n/prof_$1_$2_$3.log" | head -20 | cut -c1-200 >> "$L"
done
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && tests gpu $(( l > 320 ? 320 : l )) 8 tests/kernels/test_linear_attn.py \
  tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py tests/kernels/test_hla.py
el done
cat "$L"
