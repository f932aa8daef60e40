#!/bin/bash
# Session 11, second call (nvidia-h200; carry .whl, .hilo_cache; <= 10 min):
#  1. delta_rule wide_stages=2: GPU tests at K = 256, timing at GDN 340m's heads (from s11_b.sh);
#  2. the illegal address of s11_a.sh's scan_cols=64,scan_levels=4 at H3 K256 V512: which kernel, which tile
#     (s11_crash.py, one process per variant, CUDA_LAUNCH_BLOCKING=1, eager glue);
#  3. Transformer 2K compiled with trainer.compile_mode=max-autotune-no-cudagraphs (s11_a.sh ran out of time).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "delta_rule wide_stages=2: GPU tests at K = 256, then timing at GDN 340m's heads" | tee -a $L
HILO_DELTA_RULE=wide_stages=2 timeout 100 python -m pytest -p no:logging -rf -n 4 tests/kernels/test_gpu_head_dims.py \
  -k "delta_rule and not loglinear" > /tmp/w.log 2>&1; echo "rc=$?" >> $L
grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/w.log | sort -u | tail -6 | cut -c1-240 >> $L
timeout 100 python -u benchmarks/option_sweep.py --op delta_rule --seq-len 16384 --heads 3 --dim 256 --dim-v 512 \
  --skip-check --append --variants "" "HILO_DELTA_RULE=wide_stages=2" > /tmp/o.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
for var in "scan_cols=64,scan_levels=4" "scan_levels=4" "scan_cols=64"; do
  el "fault hunt HILO_LOGLINEAR=$var" | tee -a $L
  HILO_LOGLINEAR=$var HILO_LOGLINEAR_DELTA=glue=eager CUDA_LAUNCH_BLOCKING=1 timeout 60 \
    python -u benchmarks/gpu_sessions/s11_crash.py >> $L 2>&1; echo "rc=$?" >> $L
done
left=$(( 570 - $(date +%s) + T0 )); el "transformer 2K max-autotune-no-cudagraphs (${left}s)" | tee -a $L
timeout $left python -u benchmarks/train_throughput.py --steps 16 --compile --append --models transformer \
  --seq-lens 2048 trainer.compile_mode=max-autotune-no-cudagraphs > /tmp/t.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| transformer " /tmp/t.log | head -1 >> $L; grep -E "Error" /tmp/t.log | tail -2 | cut -c1-250 >> $L
tail -5 /tmp/t.log | cut -c1-200 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
