#!/bin/bash
# Second call of session 14 (nvidia-h200; carry .whl; <= 9.5 min). s14_a.sh found HILO_HLA=compose16=1 fast
# (fwd+bwd at 16K x 2: hla2 4.36 ms against the fused 7.10, ahla 4.43, hla3 6.61; hla2 at hla_mamba2's heads 6.08
# against 11.38) and within the bf16 check for hla2, but not ahla (dg 2.06e-2 > 2e-2) or hla3 (dg 4.48e-2). After
# it, linear_attn's backward takes dg per chunk from <dS_out, S_out> instead of one reverse cumsum of cancelling
# terms over the whole document (its own bf16 dg was 1.76e-2 at T = 777). This call checks that:
# 1. linear_attn's bf16 check table and timing at 16K (kernels.py), then compose16's check for hla2, ahla, hla3;
# 2. the GPU tests it touches: test_linear_attn.py, the bf16 tests (compose16's included) and the head-dim tests;
# 3. hla_mamba2's compiled 8K step (52,237 tokens/s in session 8) on the fused kernels and on compose16.
source benchmarks/gpu_sessions/lib.sh
el "linear_attn check + time at 16K"
timeout -s INT -k 10 90 python -u benchmarks/kernels.py --ops linear_attn --seqlens 16384 --append \
  > "$OUT/n/la.log" 2>&1; echo "rc=$?" >> "$L"; grep -E "^\| linear_attn|^\| 16384" "$OUT/n/la.log" >> "$L"
cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
sweep 60 hla2 --op hla2 --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 60 ahla --op ahla --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 60 hla3 --op hla3 --seq-len 16384 --variants "HILO_HLA=compose16=1"
tests gpu 230 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  -k "(triton or grouped or compose16 or linear_attn or hla2 or ahla) and not loglinear"
l=$(left); [ "$l" -gt 80 ] && throughput $(( l > 150 ? 150 : l )) hla_mamba2 --steps 12 --compile \
  --models hla_mamba2 --seq-lens 8192
l=$(left); [ "$l" -gt 80 ] && HILO_HLA=compose16=1 throughput "$l" hla_mamba2_c16 --steps 12 --compile \
  --models hla_mamba2 --seq-lens 8192 ++model.mixer_kwargs.backend=triton
el done
cat "$L"
