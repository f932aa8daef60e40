#!/bin/bash
# Planned first call of session 18 (nvidia-h200; carry .whl; <= 9.5 min). After session 17's device time, hla2's one
# op was extended to any V (its accumulation sits in the first pass, whose values are the keys), so hla_mamba2's
# heads (K = 128, V = 64) now take it, and hla3's three passes became one op too: CPU-tested (fp32, interpreter),
# AOT-compiled for sm_90, never run on a GPU. 1. their bf16 checks (the new test_bf16_hla_composition_head_dims,
# the one-op tests, compose16); 2. hla2 at hla_mamba2's heads with and without it (s17_c: 5.127 ms with the
# separate passes at 4 warps), hla3 at 16K with and without; 3. compiled 340m
# throughput where the table's numbers are stale or the defaults changed: the Transformer at 16K (session 8's 91,343
# is the 2x baseline), hla_mamba2 8K, hla_transformer and hla3_transformer at 16K.
source benchmarks/gpu_sessions/lib.sh
tests checks 150 8 tests/kernels/test_gpu_head_dims.py tests/kernels/test_hla.py tests/kernels/test_gpu_bf16.py \
  -k "hla_composition or one_op or compose16"
sweep 70 hla2_m2 --op hla2 --backend triton --seq-len 8192 --heads 32 --dim 128 --dim-v 64 --skip-check --rounds 2 \
  --variants "" "HILO_HLA=one_op=0"
# hla3's passes as one op (also new after session 17's device time; K = V, so the sweep's check covers it)
sweep 80 hla3_one --op hla3 --seq-len 16384 --rounds 2 --variants "" "HILO_HLA=one_op=0"
for spec in "transformer 16384" "hla_mamba2 8192" "hla_transformer 16384" "hla3_transformer 16384"; do
  set -- $spec
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] || break
  throughput $(( l > 110 ? 110 : l )) "$1_$2" --steps 12 --compile --models "$1" --seq-lens "$2"
done
el done
cat "$L"
