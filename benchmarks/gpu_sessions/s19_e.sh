#!/bin/bash
# Fifth call of session 19 (nvidia-h200; carry .whl; run with BUDGET=290), written after s19_c: the two op-sweep
# winners in compiled training at 8K x 4. ahla's 32 output / dvalues columns (4.838 against 5.483 ms fwd+bwd at the
# HLA GDN's heads) and loglinear_attn's split node grads at 4 warps (7.519 against 8.435 ms at log-linear Mamba-2's).
source benchmarks/gpu_sessions/lib.sh
HILO_HLA=out_by=32,dvalues_bv=32 throughput 120 hla_gdn_8192_by32 --steps 10 --compile --models hla_gated_deltanet \
  --seq-lens 8192
l=$(( $(left) - 5 ))
[ "$l" -gt 70 ] && HILO_LOGLINEAR=node_grads_split=1,node_grads_warps=4 throughput "$l" llm2_8192_split4 --steps 10 \
  --compile --models loglinear_mamba2 --seq-lens 8192
el done
cat "$L"
