#!/bin/bash
# Planned first call of session 16 (nvidia-h200; carry .whl; <= 9.5 min). Session 15 left linear_attn's sequential
# state kernels as the long-T cost (profile: 0.74 of 2.26 ms at 16K x 2, 1.35 of 2.87 at 32K x 1, ~1.4 us a chunk
# whatever the tile) and committed HILO_LINEAR_ATTN=state_segments (off; CPU-tested: the same values in 2 or 3
# segments): each walk split into shorter ones side by side, one pass more over all but the last segment. If it
# wins, make segment_count's rule (state_segments=0) the default; issue 5's hla2 at 16K needs 3.92 ms (4.14 now).
# 1. check + time linear_attn at 16K x 2 and 32K x 1, segments off / rule / 2 / 8 / 16; 2. hla2 compose16 at
# 16K with the rule; 3. the GPU tests with 4 segments forced on every fixed-length call (as on CPU); 4. compiled
# Mamba-2 16K with the rule (124,250 tokens/s in s15_d without). Also, at 16K, the fused backward at 4 warps (it
# spills 488 B a thread there, AOT, but two blocks fit a multiprocessor; never timed).
source benchmarks/gpu_sessions/lib.sh
# The first launch is a plain sum of products per segment (no chain through the state), so by the second launch's
# walk length alone (256 programs at 16K x 2 and at 32K x 1; 6-7 state-kernel blocks fit a multiprocessor, ~800-920
# on the GPU): 2 segments halve the walk, 3 (the rule's choice) take a third, 8 and 16 two and four waves of an
# eighth / a sixteenth (a quarter).
V=("" "HILO_LINEAR_ATTN=state_segments=0" "HILO_LINEAR_ATTN=state_segments=2" "HILO_LINEAR_ATTN=state_segments=3" \
   "HILO_LINEAR_ATTN=state_segments=8" "HILO_LINEAR_ATTN=state_segments=16")
sweep 120 la16 --op linear_attn --seq-len 16384 --variants "${V[@]}" "HILO_LINEAR_ATTN=bwd_warps=4"
sweep 100 la32 --op linear_attn --seq-len 32768 --variants "${V[@]}"
sweep 80 hla2 --op hla2 --backend triton --seq-len 16384 --variants "" "HILO_LINEAR_ATTN=state_segments=0"
HILO_LINEAR_ATTN=state_segments=4 tests gpu 120 8 tests/kernels/test_linear_attn.py tests/kernels/test_gpu_bf16.py \
  -k "triton or segment or linear_attn or compose16"
l=$(( $(left) - 5 )); [ "$l" -gt 40 ] && sweep $(( l > 50 ? 50 : l )) hla2_32 --op hla2 --backend triton --seq-len 32768 \
  --skip-check --variants "" "HILO_LINEAR_ATTN=state_segments=0"
l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && HILO_LINEAR_ATTN=state_segments=0 throughput $(( l > 80 ? 80 : l )) mamba2 \
  --steps 12 --compile --models mamba2 --seq-lens 16384
el done
cat "$L"
