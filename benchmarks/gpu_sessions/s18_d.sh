#!/bin/bash
# Last call of session 18 (nvidia-h200; carry .whl; ~6.5 min, the session's remaining device time). s18_c's profile
# of hla_transformer at 16K (1.88x the Transformer; 2x needs 6% less step) puts linear_attn's forward state walk at
# 11.5 ms a step and the backward's at 6.9: 340m's heads are K = V = 64, so 16K x 2 x H 16 is 128 programs of 32x32,
# a narrow grid, and its 256-chunk walk is under the rule's 512-chunk minimum, set by a call's host time (session 17),
# which a busy compiled step hides. 1. hla2 at that shape, checked, with 6 segments forced (the rule's count there);
# 2. compiled hla_transformer 16K with them; 3. Mamba-2 8K (s18_c re-measured the Transformer's 8K bar at 129,969;
# Mamba-2's 128,142 is session 9's); 4. hla3_transformer's decoding again in 3 rounds (s18_c: x1.17, its 1K rounds
# x1.16 apart); 5. log-linear GDN 8K's step profile, one step (s18_c's ran past 95 s while compiling).
BUDGET=${BUDGET:-385}
source benchmarks/gpu_sessions/lib.sh
sweep 60 hla2_d64 --op hla2 --seq-len 16384 --heads 16 --dim 64 --rounds 2 --variants "" \
  "HILO_LINEAR_ATTN=state_segments=6"
HILO_LINEAR_ATTN=state_segments=6 throughput 70 hla_transformer_16384_seg6 --steps 12 --compile \
  --models hla_transformer --seq-lens 16384
throughput 70 mamba2_8192 --steps 12 --compile --models mamba2 --seq-lens 8192
el "decode hla3_transformer"
timeout -s INT -k 10 90 python -u benchmarks/decode.py --contexts 1024 32768 --families hla3_transformer \
  --compile-decoding --rounds 3 --append > "$OUT/n/decode.log" 2>&1
echo "rc=$?" >> "$L"; grep -E "^\| [a-z]|^- " "$OUT/n/decode.log" | cut -c1-200 >> "$L"
cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
l=$(( $(left) - 5 ))
if [ "$l" -gt 60 ]; then
  el "step_profile loglinear_gated_deltanet 8192 (${l}s)"
  timeout -s INT -k 10 "$l" python -u benchmarks/step_profile.py --families loglinear_gated_deltanet --seq-len 8192 \
    --compile --steps 1 --top 14 > "$OUT/n/prof_loglinear_gated_deltanet_8192.log" 2>&1
  echo "rc=$?" >> "$L"; grep -vE "^\s*$|USDT" "$OUT/n/prof_loglinear_gated_deltanet_8192.log" | tail -18 \
    | cut -c1-170 >> "$L"
fi
el done
cat "$L"
