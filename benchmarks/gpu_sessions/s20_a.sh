#!/bin/bash
# Planned first call of a session after 19 (nvidia-h200; carry .whl; <= 9.5 min): the loose ends session 19 left.
# 1. The 16K rows of the three families whose defaults session 19 changed (they are from sessions 8-18, before it).
# 2. Compiled decoding in "reduce-overhead" mode (CUDA graphs over the recurrent states kept at fixed addresses since
#    commit 89801d0), never run on a GPU since that fix, for Mamba-2 and the Transformer at 1K / 32K, three rounds.
# 3. Step profiles of the HLA GDN and log-linear GDN at 8K under the new defaults, as time allows.
source benchmarks/gpu_sessions/lib.sh
for m in hla_gated_deltanet loglinear_mamba2; do
  throughput 90 "${m}_16384" --steps 8 --compile --models "$m" --seq-lens 16384
done
throughput 120 llgdn_16384 --steps 4 --compile --models loglinear_gated_deltanet --seq-lens 16384
l=$(( $(left) - 5 ))
if [ "$l" -gt 90 ]; then
  el "decoding, reduce-overhead"
  timeout -s INT -k 10 $(( l > 150 ? 150 : l )) python -u benchmarks/decode.py --contexts 1024 32768 \
    --families mamba2 transformer --compile-decoding reduce-overhead --rounds 3 --append > "$OUT/n/decode_ro.log" 2>&1
  echo "rc=$?" >> "$L"; grep -E "^- |Error" "$OUT/n/decode_ro.log" | cut -c1-220 >> "$L"
  cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
fi
for spec in "hla_gated_deltanet 8192" "loglinear_gated_deltanet 8192 --steps 1"; do
  set -- $spec
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] || break
  profile $(( l > 95 ? 95 : l )) "$@"
done
el done
cat "$L"
