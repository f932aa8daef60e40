#!/bin/bash
# Fifth call of session 15 (nvidia-h200; carry .whl; ~11 min of device time left). The working tree's new defaults:
# linear_attn's sequential state kernels at 3 stages (s15_c / s15_d: 0.4-1% faster in three paired sweeps) and 32x32
# tiles on grids under 256 programs (32K x 1: 2.47 against 2.59 ms), short_conv's backward "auto" (graph under
# torch.compile, split in eager; graph won 4 of 4 paired compiled runs, +1.2-2.4%). 1. the GPU tests they touch;
# 2. linear_attn and hla2 at 16K and 32K under them; 3. compiled Gated DeltaNet at 8K on "auto".
source benchmarks/gpu_sessions/lib.sh
tests gpu 280 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py tests/kernels/test_gpu_head_dims.py \
  tests/kernels/test_short_conv.py -k "(triton or grouped or compose16 or linear_attn or hla or split or state or gpu or graph or auto) and not loglinear"
el "linear_attn hla2 at 16K 32K"
timeout -s INT -k 10 100 python -u benchmarks/kernels.py --ops linear_attn hla2 --seqlens 16384 32768 --skip-check --append \
  > "$OUT/n/kern.log" 2>&1; echo "rc=$?" >> "$L"
grep -E "^\| [0-9]+ \|" "$OUT/n/kern.log" | cut -c1-200 >> "$L"; cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && throughput $(( l > 80 ? 80 : l )) gdn_auto --steps 12 --compile \
  --models gated_deltanet --seq-lens 8192
el done
cat "$L"
