#!/bin/bash
# Planned first call of session 11 (nvidia-h200; carry .whl, .hilo_cache; <= 10 min):
#  1. loglinear_delta_rule's level-scan tiles (16K x 2, H = 16, K = V = 128). The AOT audit for sm_90 (Triton 3.6,
#     benchmarks/triton_resources.py) has the default (S = 8 stacked levels x BV = 16, 8 warps) spilling 216 B in the
#     forward scan with reads and 56 B in the backward; scan_cols=64,scan_levels=4 (S = 4 x 16: twice the programs,
#     half the columns each) spills nothing in any scan; HILO_LOGLINEAR_DELTA=scan_rows=32 (the forward scan's
#     pieces in two row halves) takes its spill from 216 to 16 B and its shared memory from 131 to 82 KB (at K = 256
#     it spills more, 712 B, so it is timed at K = 128 only). Checked and timed side by side (option_sweep.py).
#  2. the same at Gated DeltaNet 340m's heads (H = 3, K = 256, V = 512) with this session's compiled glue;
#  3. log-linear GDN 340m at 8K compiled (value_block 512 and the compiled glue since session 10);
#  4. the Transformer at 2K with trainer.compile_mode=max-autotune-no-cudagraphs (issue 7's 45% MFU; 41.2% now).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "scan tiles, H16 K=V=128" | tee -a $L
timeout 200 python -u benchmarks/option_sweep.py --op loglinear_delta_rule --seq-len 16384 --append --variants "" \
  "HILO_LOGLINEAR=scan_cols=64,scan_levels=4" "HILO_LOGLINEAR=scan_levels=4" "HILO_LOGLINEAR_DELTA=scan_rows=32" \
  "HILO_LOGLINEAR=scan_cols=64,scan_levels=4;HILO_LOGLINEAR_DELTA=scan_rows=32" \
  > /tmp/o.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L
el "scan tiles, H3 K256 V512" | tee -a $L
timeout 120 python -u benchmarks/option_sweep.py --op loglinear_delta_rule --seq-len 16384 --heads 3 --dim 256 \
  --dim-v 512 --skip-check --append --variants "" "HILO_LOGLINEAR=scan_cols=64,scan_levels=4" > /tmp/o2.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o2.log | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "loglinear_gated_deltanet 8K compiled" | tee -a $L
timeout 100 python -u benchmarks/train_throughput.py --steps 10 --compile --append --models loglinear_gated_deltanet \
  --seq-lens 8192 > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| loglinear_gated_deltanet " /tmp/c.log | head -1 >> $L
grep -E "Error" /tmp/c.log | tail -2 | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
left=$(( 560 - $(date +%s) + T0 )); el "transformer 2K max-autotune-no-cudagraphs (${left}s)" | tee -a $L
timeout $left python -u benchmarks/train_throughput.py --steps 16 --compile --append --models transformer \
  --seq-lens 2048 trainer.compile_mode=max-autotune-no-cudagraphs > /tmp/t.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| transformer " /tmp/t.log | head -1 >> $L; grep -E "Error" /tmp/t.log | tail -2 | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
