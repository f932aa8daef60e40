#!/bin/bash
# Planned second call of session 16 (nvidia-h200; carry .whl; <= 9.5 min), after s16_a.sh and whatever default it
# changes. Issue 7 asks for every miss explained with a profile; the ones in RESULTS.md are from before most of the
# kernel work (Mamba-2 16K: session 8; GDN 8K: session 12). Compiled step profiles under the current defaults: GDN at
# 8K (0.92x the Transformer), Mamba-2 at 16K (1.36x against 2x), the Transformer at 2K (41.9% MFU against 45%), then
# hla_mamba2 at 8K (0.74x) as time allows. Each profile's table goes to the log; copy the top rows to RESULTS.md.
# First (added after s16_a.sh measured state_segments slower at 16K x 2 and 32K x 1, 256 programs): the one case left
# where segments could pay, few programs: B = 1, H = 4 at 32K (64 state programs; the rule takes 12 segments).
source benchmarks/gpu_sessions/lib.sh
sweep 70 la32h4 --op linear_attn --seq-len 32768 --heads 4 --variants "" "HILO_LINEAR_ATTN=state_segments=0" \
  "HILO_LINEAR_ATTN=state_segments=4"
for spec in "gated_deltanet 8192" "mamba2 16384" "transformer 2048" "hla_mamba2 8192"; do
  set -- $spec
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] || break
  el "step_profile $1 $2"
  timeout -s INT -k 10 $(( l > 110 ? 110 : l )) python -u benchmarks/step_profile.py --families "$1" --seq-len "$2" \
    --compile --top 18 > "$OUT/n/prof_$1_$2.log" 2>&1
  echo "rc=$?" >> "$L"; grep -vE "^\s*$" "$OUT/n/prof_$1_$2.log" | tail -24 | cut -c1-170 >> "$L"
done
el done
cat "$L"
