#!/bin/bash
# Session 11, third call (nvidia-h200; carry .whl, .hilo_cache; <= 10 min):
#  1. delta_rule's GPU head-dim tests with wide_stages=2 now the default for 16-bit inputs only (fp32 at K = 256
#     failed with it in s11_b2.sh: 267 KB of shared memory in the AOT audit);
#  2. loglinear_delta_rule with scan_cols=64,scan_levels=4 at GDN's heads after the >= 32-column clamp (it faulted);
#  3. log-linear GDN 340m 8K compiled (s11_a.sh's 100 s were too few: the compiled glue builds for ~110 s);
#  4. GDN 340m 8K compiled with the two-stage state passes.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "delta_rule GPU head-dim tests (wide_stages default 2)" | tee -a $L
timeout 100 python -m pytest -p no:logging -rf -n 4 tests/kernels/test_gpu_head_dims.py \
  -k "delta_rule and not loglinear" > /tmp/w.log 2>&1; echo "rc=$?" >> $L
grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/w.log | sort -u | tail -6 | cut -c1-240 >> $L
el "clamped scan tiles at GDN heads" | tee -a $L
HILO_LOGLINEAR=scan_cols=64,scan_levels=4 HILO_LOGLINEAR_DELTA=glue=eager CUDA_LAUNCH_BLOCKING=1 timeout 60 \
  python -u benchmarks/gpu_sessions/s11_crash.py >> $L 2>&1; echo "rc=$?" >> $L
left=$(( 300 - $(date +%s) + T0 )); el "loglinear_gated_deltanet 8K compiled (${left}s)" | tee -a $L
timeout $left python -u benchmarks/train_throughput.py --steps 10 --compile --append --models loglinear_gated_deltanet \
  --seq-lens 8192 > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| loglinear_gated_deltanet " /tmp/c.log | head -1 >> $L
grep -E "Error" /tmp/c.log | tail -2 | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
left=$(( 570 - $(date +%s) + T0 )); el "gated_deltanet 8K compiled (${left}s)" | tee -a $L
timeout $left python -u benchmarks/train_throughput.py --steps 10 --compile --append --models gated_deltanet \
  --seq-lens 8192 > /tmp/g.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| gated_deltanet " /tmp/g.log | head -1 >> $L
grep -E "Error" /tmp/g.log | tail -2 | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
