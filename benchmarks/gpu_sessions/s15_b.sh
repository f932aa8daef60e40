#!/bin/bash
# Planned second call of session 15 (nvidia-h200; carry .whl; <= 9.5 min), after s15_a.sh: issue 5's hla2 at 0.75x
# fla's two passes needs linear_attn at ~1.85 ms fwd+bwd at 16K (2.18 in s14_d). Its sequential state kernels walk
# every chunk one after another (session 3 at 32K x 1: 1.4 of 3.5 ms); HILO_LINEAR_ATTN's state_bk / state_bv /
# state_warps (session 14, CPU-tested: same values under every tiling) give them more, smaller programs.
# Sweep at 16K x 2 and 32K x 1 with the check, then hla2 (compose16) with the best two by hand if time allows.
source benchmarks/gpu_sessions/lib.sh
V=("" "HILO_LINEAR_ATTN=state_bv=16" "HILO_LINEAR_ATTN=state_bv=16,state_warps=2" "HILO_LINEAR_ATTN=state_bk=32,state_bv=32" \
   "HILO_LINEAR_ATTN=state_bk=32,state_bv=16,state_warps=2" "HILO_LINEAR_ATTN=state_bv=16,state_warps=1")
sweep 150 la16 --op linear_attn --seq-len 16384 --variants "${V[@]}"
sweep 120 la32 --op linear_attn --seq-len 32768 --skip-check --variants "${V[@]}"
sweep 120 hla2 --op hla2 --backend triton --seq-len 16384 --skip-check --variants "${V[@]:0:4}"
# hla3 is traced under compile since session 14 (its composition's linear_attn ops in the graph; it used to run
# eagerly between graphs): the compiled hla3 Transformer at 8K, never measured
l=$(left); [ "$l" -gt 70 ] && throughput $(( l > 120 ? 120 : l )) hla3_tr --steps 12 --compile --models hla3_transformer \
  --seq-lens 8192
el done
cat "$L"
