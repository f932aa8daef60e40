#!/bin/bash
# Planned first call of session 15 (nvidia-h200; carry .whl; <= 9.5 min). What session 14 committed after its
# device time ran out, in the order a failure would matter:
# 1. linear_attn's backward takes dg's per-chunk value inside the chunk programs (commit a58ca0e,
#    "take dg's per-chunk value at the chunk's first token"): exact in fp32 on CPU, never run on a GPU. The check
#    (dg was 4.71e-3 with the dstates-pass form) and the time (2.18 ms at 16K with that form, which took the
#    dstates pass to 228 registers; this one keeps it at 128, AOT) at 16K; then its GPU tests. If the check or a
#    test fails, revert that commit (723e86f's form is measured and correct).
# 2. HILO_LINEAR_ATTN=split_scores=1 (off; a float64 emulation says o 3.71e-3 -> 3.34e-3 for linear_attn, ahla's
#    bf16 composition 4.96e-3 -> 4.31e-3 of its 5e-3 bound): linear_attn and ahla compose16 with the check, timed.
#    If it holds and costs little, make it the default and then consider ahla on compose16 (4.7 ms against 7.1).
# 3. hla2 compose16 at 16K under the defaults (4.63 ms in s14_d).
source benchmarks/gpu_sessions/lib.sh
sweep 70 la --op linear_attn --seq-len 16384 --variants "" "HILO_LINEAR_ATTN=split_scores=1"
sweep 60 ahla16 --op ahla --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1" \
  "HILO_HLA=compose16=1;HILO_LINEAR_ATTN=split_scores=1"
sweep 50 hla2 --op hla2 --backend triton --seq-len 16384 --variants "" "HILO_LINEAR_ATTN=split_scores=1"
l=$(( $(left) - 20 ))
[ "$l" -gt 60 ] && tests gpu $l 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py \
  tests/kernels/test_gpu_head_dims.py -k "(triton or grouped or compose16 or linear_attn or hla or split) and not loglinear"
el done
cat "$L"
