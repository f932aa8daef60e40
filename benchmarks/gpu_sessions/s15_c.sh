#!/bin/bash
# Third call of session 15 (nvidia-h200; carry .whl; <= 9.5 min). s15_b.sh: hla2 compose16 meets issue 5's 0.75x of
# fla's two passes to 8K (0.73-0.75x) and misses it at 16K / 32K (0.79x: 4.13 / 5.34 ms, two linear_attn passes of
# ~2.02 / ~2.6 ms); the state tiles gave nothing at 16K x 2. Where linear_attn's time goes at 16K x 2 and 32K x 1
# (profile), whether the sequential state kernels gain from deeper software pipelining (state_stages, new), the
# tiles at 32K x 1 (16 sequence-heads: 128 programs of the default tile on 132 SMs), then the compiled hla3
# Transformer at 8K (traced under compile since session 14; never measured).
source benchmarks/gpu_sessions/lib.sh
for T in 16384 32768; do
  el "profile linear_attn $T"
  timeout -s INT -k 10 60 python -u benchmarks/kernels.py --ops linear_attn --seqlens $T --skip-check --skip-bench \
    --profile $T > "$OUT/n/prof_$T.log" 2>&1; echo "rc=$?" >> "$L"
  grep -E "wall|_chunk|Self CUDA time" "$OUT/n/prof_$T.log" | cut -c1-160 >> "$L"
done
V=("" "HILO_LINEAR_ATTN=state_stages=1" "HILO_LINEAR_ATTN=state_stages=3" "HILO_LINEAR_ATTN=state_stages=4")
sweep 110 la16 --op linear_attn --seq-len 16384 --variants "${V[@]}"
sweep 110 la32 --op linear_attn --seq-len 32768 --skip-check --variants "${V[@]}" "HILO_LINEAR_ATTN=state_bv=16" \
  "HILO_LINEAR_ATTN=state_bk=32,state_bv=32"
l=$(( $(left) - 5 )); [ "$l" -gt 70 ] && throughput $(( l > 150 ? 150 : l )) hla3_tr --steps 12 --compile \
  --models hla3_transformer --seq-lens 8192
el done
cat "$L"
