#!/bin/bash
# Planned last call of session 17 (nvidia-h200; carry .whl; ~520 s of device time left). s17_c: linear_attn's
# backward at 4 warps won at every shape timed (Mamba-2's heads 2.520 -> 1.952 ms, hla2 at hla_mamba2's 5.783 ->
# 5.127), and the GPU tests failed one test: chunk_bwd launched its dstates kernel before refusing an accumulation
# its one-tile kernel cannot take (CPU tensors, so the launch failed first); the refusal now comes first. 1. that
# test; 2. compiled 340m training under the new defaults where linear_attn dominates (Mamba-2 16K, hla_mamba2 8K);
# 3. test_linear_attn on the GPU (s17_c reached 23 of its cases).
BUDGET=${BUDGET:-515}
source benchmarks/gpu_sessions/lib.sh
tests one_op 90 4 tests/kernels/test_hla.py -k one_op
throughput 110 mamba2 --steps 12 --compile --models mamba2 --seq-lens 16384
throughput 130 hla_mamba2 --steps 12 --compile --models hla_mamba2 --seq-lens 8192
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && tests la $l 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py \
  -k "linear_attn or compose"
el done
cat "$L"
