#!/bin/bash
# Planned third call of session 19 (nvidia-h200; carry .whl; <= 9.5 min): launch settings never timed at the heads
# where two misses spend their steps. 1. ahla's fused chunk kernels at the HLA Gated DeltaNet's heads (H = 3, K = V =
# 256 per value block, 8K x 4): _chunk_out and _pass_dvalues (65.8 + 65.3 of its 433.8 kernel-ms, s18_c) take 255
# registers, spill 64-80 B and run one program a multiprocessor; sm_90 AOT (session 18): 64-wide K loops
# (out_bk=64,dvalues_bk=64) 153-221 registers, no spills, two a multiprocessor; 32 output columns likewise at 234-255.
# 2. loglinear_attn's untimed node-form options at log-linear Mamba-2's heads (H = 32, K = 128, V = 64, 8K x 4),
# whose _grads (61.9 ms) and _intra_bwd (34.4) lead its step profile. 3. The winner of 1 in compiled training (HLAGDN,
# e.g. HLAGDN="HILO_HLA=out_bk=64,dvalues_bk=64" bash s19_c.sh).
source benchmarks/gpu_sessions/lib.sh
sweep 150 ahla_gdn --op ahla --seq-len 8192 --tokens 32768 --heads 3 --dim 256 --dim-v 256 --rounds 2 --variants "" \
  "HILO_HLA=out_bk=64,dvalues_bk=64" "HILO_HLA=out_by=32,dvalues_bv=32" "HILO_HLA=out_warps=8,dvalues_warps=8"
sweep 150 llattn_m2 --op loglinear_attn --seq-len 8192 --tokens 32768 --heads 32 --dim 128 --dim-v 64 --skip-check \
  --variants "" "HILO_LOGLINEAR=node_grads_split=1" "HILO_LOGLINEAR=node_save=1" \
  "HILO_LOGLINEAR=node_grads_split=1,node_grads_warps=4"
if [ -n "$HLAGDN" ]; then  # "HILO_X=a;HILO_Y=b": set for this run only
  l=$(( $(left) - 5 ))
  [ "$l" -gt 70 ] && eval "$(echo "$HLAGDN" | tr ';' ' ') throughput $(( l > 110 ? 110 : l )) hla_gdn_8192_opt \
    --steps 10 --compile --models hla_gated_deltanet --seq-lens 8192"
fi
el done
cat "$L"
