#!/bin/bash
# Planned third call of session 17 (nvidia-h200; carry .whl; <= 9.5 min). s17_a measured linear_attn's fused backward
# at 4 warps faster at 16K x 2 (1.910 against 1.979 ms) and hla2's passes as one op faster (4.015 against 4.089;
# 3.899 with both), and both are now the defaults. 1. issue 5's table under them (linear_attn and hla2 at every T,
# 32K tokens a call); 2. the old 8 warps against the new 4 at shapes s17_a did not time: T = 2K, K = V = 64, Mamba-2's
# heads (K = 128, V = 64, H = 32) and hla2 at hla_mamba2's (8K x 4, H = 32, K = 128, V = 64); 3. the GPU tests.
source benchmarks/gpu_sessions/lib.sh
el "linear_attn hla2 at every T"
timeout -s INT -k 10 170 python -u benchmarks/kernels.py --ops linear_attn hla2 --seqlens 2048 4096 8192 16384 32768 \
  --skip-check --append > "$OUT/n/table.log" 2>&1
echo "rc=$?" >> "$L"; grep -E "^\| " "$OUT/n/table.log" | cut -c1-200 >> "$L"; cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
W8="HILO_LINEAR_ATTN=bwd_warps=8"
sweep 50 la2k --op linear_attn --seq-len 2048 --skip-check --rounds 3 --variants "" "$W8"
sweep 60 la_d64 --op linear_attn --seq-len 16384 --dim 64 --rounds 2 --variants "" "$W8"
sweep 60 la_m2 --op linear_attn --seq-len 16384 --heads 32 --dim 128 --dim-v 64 --rounds 2 --variants "" "$W8"
sweep 70 hla2_m2 --op hla2 --backend triton --seq-len 8192 --heads 32 --dim 128 --dim-v 64 --rounds 2 --variants "" \
  "$W8"
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && tests gpu $l 8 tests/kernels/test_hla.py tests/kernels/test_gpu_bf16.py \
  tests/kernels/test_gpu_head_dims.py tests/kernels/test_linear_attn.py
el done
cat "$L"
