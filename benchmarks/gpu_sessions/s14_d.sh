#!/bin/bash
# Third call of session 14 (nvidia-h200; carry .whl; <= 9.5 min): the committed forms of s14_c.sh's findings.
# 723e86f moved linear_attn's per-chunk dg sums into the fused backward kernel (s14_c timed a host-side form: 2.30 ms
# fwd+bwd at 16K against 2.07 before); 37155da made the bf16 composition (compose16) the CUDA default for bf16 hla2
# and hla3. 1. check + time linear_attn, hla2 (fused, and the compose16 baseline) and hla3 (default) at 16K, and
# ahla's compose16 check (its o sat at 5.00e-3 / 5e-3); 2. the GPU tests they touch; 3. compiled training under the
# new defaults: hla_mamba2 at 8K (87,491 tokens/s with compose16 forced in s14_c), mamba2 at 16K (121,478 in s9).
source benchmarks/gpu_sessions/lib.sh
el "kernels.py linear_attn hla2 hla3 at 16K (check + time)"
timeout -s INT -k 10 150 python -u benchmarks/kernels.py --ops linear_attn hla2 hla3 --seqlens 16384 --append \
  > "$OUT/n/kern.log" 2>&1; echo "rc=$?" >> "$L"; grep -E "\| dg \||NO \||^\| 16384" "$OUT/n/kern.log" >> "$L"
cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
sweep 50 ahla --op ahla --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1"
tests gpu 220 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  -k "(triton or grouped or compose16 or linear_attn or hla) and not loglinear"
l=$(left); [ "$l" -gt 80 ] && throughput $(( l > 120 ? 120 : l )) hla_mamba2 --steps 12 --compile \
  --models hla_mamba2 --seq-lens 8192
l=$(left); [ "$l" -gt 80 ] && throughput "$l" mamba2 --steps 12 --compile --models mamba2 --seq-lens 16384
el done
cat "$L"
