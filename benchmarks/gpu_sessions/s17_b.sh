#!/bin/bash
# Planned second call of session 17 (nvidia-h200; carry .whl; <= 9.5 min): the GPU tests, with the session-16 code
# paths forced in turn where the defaults do not reach them: the default (state segments on long walks of narrow
# grids), 4 segments forced, the V-looped backward (bwd_bv=32), and hla2's one op.
source benchmarks/gpu_sessions/lib.sh
tests gpu 200 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  tests/kernels/test_hla.py
HILO_LINEAR_ATTN=state_segments=4,bwd_bv=32 tests gpu_forced 150 8 tests/kernels/test_linear_attn.py \
  tests/kernels/test_gpu_bf16.py -k "triton or linear_attn or compose16"
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && HILO_HLA=one_op=1 tests gpu_one_op $l 8 tests/kernels/test_hla.py \
  tests/kernels/test_gpu_bf16.py -k "hla2 or compose16"
el done
cat "$L"
