#!/bin/bash
# Last call of session 15 (nvidia-h200; carry .whl; ~5.5 min of device time left; BUDGET=290). 1. linear_attn's
# chunk-parallel launches at 16K x 2 (the fused backward is 0.89 of its 2.26 ms there: one 8-warp CTA per SM at 252
# registers, unpipelined): bwd_stages 2 / 3, out_warps 8, out_stages 3, with the check. 2. compiled 340m rows of
# README's table not measured since the bf16 composition became the default: hla_mamba2, hla_transformer at 16K
# (session 8, fused), hla3_transformer at 16K, ahla_transformer at 8K (never).
source benchmarks/gpu_sessions/lib.sh
sweep 60 la16 --op linear_attn --seq-len 16384 --variants "" "HILO_LINEAR_ATTN=bwd_stages=2" \
  "HILO_LINEAR_ATTN=bwd_stages=3" "HILO_LINEAR_ATTN=out_warps=8" "HILO_LINEAR_ATTN=out_stages=3"
for m in "hla_mamba2 16384" "hla_transformer 16384" "hla3_transformer 16384" "ahla_transformer 8192"; do
  set -- $m
  l=$(( $(left) - 3 )); [ "$l" -gt 45 ] && throughput $(( l > 60 ? 60 : l )) "$1_$2" --steps 12 --compile --models $1 \
    --seq-lens $2
done
el done
cat "$L"
