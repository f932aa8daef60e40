#!/bin/bash
# Planned second call of session 19 (nvidia-h200; carry .whl; <= 9.5 min), after s19_a.sh. Session 18 changed
# loglinear_delta_rule's kernels on the CPU only: the forward level scan loads Kd after its product with W (sm_90 AOT
# at K = 256: 472 -> 8 B of spills, 160 -> 96 KB shared) and pieces=fp16 also covers zcols. 1. Their GPU tests
# (test_loglinear_delta_rule.py, and the loglinear_delta_rule bf16 / head-dim tests), with pieces=fp16 too;
# 2. compiled log-linear GDN 340m at 8K (12,921 tokens/s in session 11) with the defaults and with LLGDN, the
# HILO_* setting s19_a's sweep found best (e.g. LLGDN="HILO_LOGLINEAR_DELTA=pieces=fp16" bash s19_b.sh).
source benchmarks/gpu_sessions/lib.sh
tests lldr 150 8 tests/kernels/test_loglinear_delta_rule.py
tests lldr_bf16 80 8 tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py -k "loglinear_delta_rule"
HILO_LOGLINEAR_DELTA=pieces=fp16 tests lldr_fp16 80 8 tests/kernels/test_gpu_bf16.py \
  tests/kernels/test_gpu_head_dims.py -k "loglinear_delta_rule"
throughput 110 llgdn_8192 --steps 8 --compile --models loglinear_gated_deltanet --seq-lens 8192
if [ -n "$LLGDN" ]; then  # "HILO_X=a;HILO_Y=b": set for this run only
  l=$(( $(left) - 5 ))
  [ "$l" -gt 70 ] && eval "$(echo "$LLGDN" | tr ';' ' ') throughput $(( l > 110 ? 110 : l )) llgdn_8192_opt --steps 8 \
    --compile --models loglinear_gated_deltanet --seq-lens 8192"
fi
el done
cat "$L"
