#!/bin/bash
# Fourth call of session 15 (nvidia-h200; carry .whl; <= 9.5 min). s15_c.sh: at 32K x 1 linear_attn's sequential
# state kernels are 1.35 of its 2.87 ms (profile), each chunk ~1.3 us whatever the tile, and 32x32 tiles (256
# programs, not 128) took it from 2.59 to 2.46 ms. The working tree narrows the tiles to 32x32 on small grids; check
# that default at 32K, time it against the old tile and smaller ones, then hla2 at 32K (5.34 ms; 0.75x fla is 5.06).
# Then issue 7: the second sample of HILO_SHORT_CONV_BWD=graph (session 14, one sample: +1.4% GDN 8K, +1.2% Mamba-2 16K).
source benchmarks/gpu_sessions/lib.sh
sweep 60 la32c --op linear_attn --seq-len 32768 --variants ""
sweep 90 la32 --op linear_attn --seq-len 32768 --skip-check --variants "" "HILO_LINEAR_ATTN=state_bk=64,state_bv=32" \
  "HILO_LINEAR_ATTN=state_bk=32,state_bv=16" "HILO_LINEAR_ATTN=state_bk=16,state_bv=32" \
  "HILO_LINEAR_ATTN=state_bk=16,state_bv=16" "HILO_LINEAR_ATTN=state_stages=3"
el "hla2 at 32K"
timeout -s INT -k 10 60 python -u benchmarks/kernels.py --ops hla2 --seqlens 32768 --skip-check --append \
  > "$OUT/n/hla_T.log" 2>&1; echo "rc=$?" >> "$L"
grep -E "^\| [0-9]+ \|" "$OUT/n/hla_T.log" | cut -c1-200 >> "$L"; cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
for m in "gated_deltanet 8192" "mamba2 16384"; do
  set -- $m
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && throughput $(( l > 75 ? 75 : l )) "$1_def" --steps 12 --compile --models $1 \
    --seq-lens $2
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] && HILO_SHORT_CONV_BWD=graph throughput $(( l > 75 ? 75 : l )) "$1_graph" \
    --steps 12 --compile --models $1 --seq-lens $2
done
el done
cat "$L"
