#!/bin/bash
# Planned third call of session 12 (nvidia-h200; carry .whl, .hilo_cache; <= 10 min): log-linear GDN's operator at its
# 340m heads (B = 2, T = 16K, H = 3, K = 256, V = 512; 29.9 ms forward, 108.4 fwd+bwd in session 11, 16.9x
# delta_rule against an arithmetic floor of 5.7x). With the default 32 stacked columns (S = 2 x BV = 16) each chunk's
# [64, 256] fp32 pieces are loaded by 128 programs per (sequence, head); scan_cols=256 gives 64 columns (half the
# programs and piece loads). AOT for sm_90 (Triton 3.6): its forward scan with reads spills 128 B instead of 472,
# its backward scan 512-552 B instead of 0-48, shared memory 197 / 147 KB (one program an SM either way); the last
# variant keeps the backward's default 32 columns (HILO_LOGLINEAR_DELTA=bwd_scan_cols=128). pieces=fp16 (session 11,
# CPU-tested only): the scans read the [64, 256] pieces as scaled fp16, half the bytes; AOT: 65-74 KB staged
# instead of 164, forward spills 192 B instead of 472; with bwd_scan_stages=2 the backward scans pipeline their
# loads (153-157 KB). Then the same options through kernels.py's bf16 check at K = V = 128.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "loglinear_delta_rule stacked columns at GDN 340m's heads" | tee -a $L
timeout -k 20 330 python -u benchmarks/option_sweep.py --op loglinear_delta_rule --seq-len 16384 --heads 3 --dim 256 \
  --dim-v 512 --skip-check --append --variants "" "HILO_LOGLINEAR=scan_cols=256" \
  "HILO_LOGLINEAR=scan_cols=256,scan_levels=16" "HILO_LOGLINEAR=scan_cols=256;HILO_LOGLINEAR_DELTA=bwd_scan_cols=128" \
  "HILO_LOGLINEAR_DELTA=pieces=fp16" "HILO_LOGLINEAR_DELTA=pieces=fp16,bwd_scan_stages=2" \
  > /tmp/o.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
left=$(( 540 - $(date +%s) + T0 )); el "pieces=fp16: kernels.py's bf16 check and timing at K = V = 128 (${left}s)" | tee -a $L
timeout -k 20 $left python -u benchmarks/option_sweep.py --op loglinear_delta_rule --seq-len 16384 --append \
  --variants "" "HILO_LOGLINEAR_DELTA=pieces=fp16" "HILO_LOGLINEAR_DELTA=pieces=fp16,bwd_scan_stages=2" \
  > /tmp/o2.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o2.log | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
