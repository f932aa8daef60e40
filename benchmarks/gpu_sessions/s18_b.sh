#!/bin/bash
# Planned second call of session 18 (nvidia-h200; carry .whl; <= 9.5 min): issue 7's table rows last measured in
# session 8 or before linear_attn's and the HLA passes' later changes (GDN 16K, log-linear Mamba-2 8K / 16K, the HLA
# Gated DeltaNet 8K, ahla_transformer 16K), compiled 340m, 12 steps each; linear_attn's launch settings at
# Mamba-2's heads; then the kernel GPU tests.
source benchmarks/gpu_sessions/lib.sh
for spec in "gated_deltanet 16384" "loglinear_mamba2 8192" "loglinear_mamba2 16384" "hla_gated_deltanet 8192" \
    "ahla_transformer 16384"; do
  set -- $spec
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] || break
  throughput $(( l > 100 ? 100 : l )) "$1_$2" --steps 12 --compile --models "$1" --seq-lens "$2"
done
# launch settings at Mamba-2's heads (H = 32, K = 128, V = 64), where 4 warps for the backward gained 23% (s17_c)
l=$(( $(left) - 5 )); [ "$l" -gt 120 ] && sweep 70 la_m2 --op linear_attn --seq-len 16384 --heads 32 --dim 128 \
  --dim-v 64 --skip-check --rounds 2 --variants "" "HILO_LINEAR_ATTN=out_stages=3" "HILO_LINEAR_ATTN=out_warps=8" \
  "HILO_LINEAR_ATTN=state_bk=64,state_bv=32" "HILO_LINEAR_ATTN=state_warps=2"
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && tests gpu $l 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py \
  tests/kernels/test_gpu_head_dims.py
el done
cat "$L"
