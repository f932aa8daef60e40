#!/bin/bash
# Planned third call of session 16 (nvidia-h200; carry .whl; <= 9.5 min), only if s16_a.sh made the segments rule
# (HILO_LINEAR_ATTN=state_segments=0) the default: issue 5's table again under it (hla2 and linear_attn at every T
# of SPEC §9, with SDPA beside them; the target is 0.75x fla's two passes: 3.39 / 3.41 / 3.53 / 3.92 / 5.06 ms), then
# the GPU tests of everything that runs linear_attn's kernels, and compiled hla_mamba2 at 8K (93,797 tokens/s in
# session 14).
source benchmarks/gpu_sessions/lib.sh
el "linear_attn hla2 at every T"
timeout -s INT -k 10 200 python -u benchmarks/kernels.py --ops linear_attn hla2 --seqlens 2048 4096 8192 16384 32768 \
  --skip-check --append > "$OUT/n/kern.log" 2>&1; echo "rc=$?" >> "$L"
grep -E "^\| [0-9]+ \|" "$OUT/n/kern.log" | cut -c1-200 >> "$L"; cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
tests gpu 200 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  -k "(triton or grouped or compose16 or linear_attn or hla or segment) and not loglinear"
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && throughput $(( l > 90 ? 90 : l )) hla_mamba2 --steps 12 --compile \
  --models hla_mamba2 --seq-lens 8192
el done
cat "$L"
