#!/bin/bash
# Second call of session 15 (nvidia-h200; carry .whl; <= 9.5 min). s15_a.sh measured linear_attn's in-chunk dg
# (a58ca0e: 1.989 ms fwd+bwd at 16K, check ok, 91 GPU tests passed) and split_scores (o 3.73e-3 -> 3.36e-3 for
# 0.5% time; ahla compose16 5.00e-3 -> 4.33e-3). The working tree makes split_scores the default and puts ahla on
# compose16 by default; before committing that: 1. bf16 numerics at T = 32,768 for all four HLA forms under the new
# defaults (session 14: hla2 / hla3 3.4-4.5e-3; ahla never measured there); 2. hla2 and ahla at every T of SPEC
# §9 (issue 5: 0.75x fla's two passes); 3. the bf16 / head-dim GPU tests; 4. the state-tile sweep, time allowing.
source benchmarks/gpu_sessions/lib.sh
el "hla_numerics at 32K (defaults)"
timeout -s INT -k 10 100 python -u benchmarks/hla_numerics.py --ops hla2 hla2_d2 ahla hla3 --backends triton \
  --normalize false --no-reference --append > "$OUT/n/num.log" 2>&1; echo "rc=$?" >> "$L"
grep -E "^\| (hla|ahla)" "$OUT/n/num.log" | cut -c1-200 >> "$L"; cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
el "hla2 ahla at every T"
timeout -s INT -k 10 150 python -u benchmarks/kernels.py --ops hla2 ahla --seqlens 2048 4096 8192 16384 32768 \
  --skip-check --append > "$OUT/n/hla_T.log" 2>&1; echo "rc=$?" >> "$L"
grep -E "^\| [0-9]+ \||^#|^ahla|^hla" "$OUT/n/hla_T.log" | cut -c1-200 >> "$L"; cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
tests gpu 170 8 tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py -k "hla or compose16 or linear_attn"
V=("" "HILO_LINEAR_ATTN=state_bv=16" "HILO_LINEAR_ATTN=state_bv=16,state_warps=2" "HILO_LINEAR_ATTN=state_bk=32,state_bv=32")
l=$(( $(left) - 5 )); [ "$l" -gt 50 ] && sweep "$l" la16 --op linear_attn --seq-len 16384 --variants "${V[@]}"
el done
cat "$L"
