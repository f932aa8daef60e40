#!/bin/bash
# Planned first call of session 17 (nvidia-h200; carry .whl; <= 9.5 min). Session 16 made linear_attn's state
# segments the default where they paid (a walk of 512+ chunks on a grid narrower than the GPU) and left one loss
# unexplained: 16K x 1, H = 8 (128 programs, 6 segments of 43 chunks) went 0.988 -> 1.204 ms fwd+bwd, the forward
# faster and the backward slower. 1. profile it both ways (kernel time against wall, forward against backward);
# 2. at 16K x 2, in three rounds each (option_sweep --rounds): bwd_warps=4 (1.979 against 2.006 ms in one s16_a
# sweep), and the V-looped backward (bwd_bv, bwd_maxnreg: new, CPU-tested; the fused backward is 0.89 of 2.0 ms);
# 3. hla2 at 16K as one op (issue 5's 16K target: 3.92 ms, 4.14 now); 4. the GPU tests at the new default with
# whatever time is left (s17_b.sh runs them in full).
source benchmarks/gpu_sessions/lib.sh
for seg in 1 6; do
  el "profile linear_attn 16K x 1 H=8 state_segments=$seg"
  HILO_LINEAR_ATTN=state_segments=$seg timeout -s INT -k 10 40 python -u benchmarks/kernels.py --ops linear_attn \
    --skip-check --skip-bench --heads 8 --tokens 16384 --profile 16384 > "$OUT/n/prof_16k_h8_$seg.log" 2>&1
  echo "rc=$?" >> "$L"; grep -E "wall|_chunk|aten|void" "$OUT/n/prof_16k_h8_$seg.log" | head -10 | cut -c1-200 >> "$L"
done
sweep 110 la16_w --op linear_attn --seq-len 16384 --skip-check --rounds 3 --variants "" "HILO_LINEAR_ATTN=bwd_warps=4"
# the V-looped backward (session 16, CPU-tested): checked once, then three rounds; its bf16 check is the first GPU run
sweep 150 la16_vloop --op linear_attn --seq-len 16384 --rounds 3 --variants "" "HILO_LINEAR_ATTN=bwd_bv=32" \
  "HILO_LINEAR_ATTN=bwd_bv=64" "HILO_LINEAR_ATTN=bwd_bv=16,bwd_maxnreg=128" \
  "HILO_LINEAR_ATTN=bwd_bv=32,bwd_maxnreg=128,bwd_stages=3" "HILO_LINEAR_ATTN=bwd_bv=32,bwd_warps=4"
# hla2's passes as one op (HILO_HLA=one_op=1, new, CPU-tested): no dq1 + dq2 / dk + dv additions (hla2 took 4.14 ms
# against 2 x 2.01 for its passes alone in s16_a); with bwd_warps=4 as well
sweep 110 hla2_one --op hla2 --backend triton --seq-len 16384 --rounds 2 --variants "" "HILO_HLA=one_op=1" \
  "HILO_HLA=one_op=1;HILO_LINEAR_ATTN=bwd_warps=4"
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && tests gpu $l 8 tests/kernels/test_linear_attn.py \
  tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py tests/kernels/test_hla.py
el done
cat "$L"
