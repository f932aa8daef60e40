#!/bin/bash
# Planned first call of session 19 (nvidia-h200; carry .whl; <= 9.5 min). 1. Log-linear GDN's level scan is 86% of
# its 340m step (s18_d: 2,149 of 2,511 kernel-ms at 8K x 4) and ~4x its FLOP floor. Its scans re-read the chunk's
# [64, 256] fp32 pieces in every program (by bytes, ~50 GB of L2 reads a forward scan at 8K x 4, H = 3). Session 12's
# options that cut those reads were CPU-tested and AOT-audited but never timed (s12_c.sh did not run):
# scan_cols=256 (64 stacked columns: half the programs), pieces=fp16 (half the bytes), bwd_scan_stages=2. Timed at
# GDN 340m's heads (H = 3, K = 256, V = 512, 8K x 4), then pieces=fp16 through kernels.py's bf16 check at K = V = 128.
# 2. Step profiles of the two unprofiled 16K misses (ahla_transformer 1.60x, hla3_transformer 1.73x). 3. linear_attn's
# per-kernel op profile at hla_transformer's heads (K = V = 64, H = 16, 16K x 2): s18_c's step profile had the
# forward state walk at 0.239 ms a call against the backward's 0.144, with the same tiles and resources.
source benchmarks/gpu_sessions/lib.sh
sweep 240 lldr_gdn --op loglinear_delta_rule --seq-len 8192 --tokens 32768 --heads 3 --dim 256 --dim-v 512 \
  --skip-check --variants "" "HILO_LOGLINEAR=scan_cols=256" "HILO_LOGLINEAR_DELTA=pieces=fp16" \
  "HILO_LOGLINEAR_DELTA=pieces=fp16,bwd_scan_stages=2" "HILO_LOGLINEAR=scan_cols=256;HILO_LOGLINEAR_DELTA=pieces=fp16"
sweep 110 lldr_check --op loglinear_delta_rule --seq-len 8192 --variants "" "HILO_LOGLINEAR_DELTA=pieces=fp16" \
  "HILO_LOGLINEAR_DELTA=pieces=fp16,bwd_scan_stages=2"
for spec in "ahla_transformer 16384" "hla3_transformer 16384"; do
  set -- $spec
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] || break
  profile $(( l > 80 ? 80 : l )) "$1" "$2"
done
l=$(( $(left) - 5 ))
if [ "$l" -gt 40 ]; then
  el "linear_attn op profile, K = V = 64"
  timeout -s INT -k 10 "$l" python -u benchmarks/kernels.py --ops linear_attn --seqlens 16384 --heads 16 --dim 64 \
    --skip-check --profile 16384 > "$OUT/n/la_d64.log" 2>&1
  echo "rc=$?" >> "$L"; grep -E "^\| |ms" "$OUT/n/la_d64.log" | tail -24 | cut -c1-170 >> "$L"
fi
el done
cat "$L"
