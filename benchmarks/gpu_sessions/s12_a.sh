#!/bin/bash
# Planned first call of session 12 (nvidia-h200; carry .whl, .hilo_cache; <= 10 min): the fused HLA kernels' launch
# settings (HILO_HLA's new <family>_warps / _stages / tiles / _maxnreg, session 11). Session 11 showed the kernels
# are not bound by their dot rate (fp16 operands at twice tf32's rate were slower); the AOT audit for sm_90 has the
# chunk kernels at 8 warps with 128-160 registers a thread, i.e. one program an SM: the sweep asks whether more
# resident programs (a 128-register cap, 4 warps, narrower tiles) or deeper pipelining (3 stages) pay. hla2 at
# 16K x 2, H = 16, D = 128 (issue 5's target: <= 3.9 ms fwd+bwd; 10.5 now) in two sweeps (each with the
# defaults), then hla2 at hla_mamba2's heads with its per-kernel profile.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "hla2 launch-setting sweep, 16K: residency" | tee -a $L
timeout -k 20 180 python -u benchmarks/option_sweep.py --op hla2 --seq-len 16384 --skip-check --append --variants "" \
  "HILO_HLA=out_maxnreg=128,dvalues_maxnreg=128,dqk_maxnreg=128" \
  "HILO_HLA=out_warps=4,dvalues_warps=4,dqk_warps=4" \
  "HILO_HLA=out_stages=3,dvalues_stages=3,dqk_stages=3" \
  "HILO_HLA=out_by=32,dvalues_bv=32,dqk_bv=16" \
  > /tmp/o.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "hla2 launch-setting sweep, 16K: wide tiles and the scans" | tee -a $L
timeout -k 20 200 python -u benchmarks/option_sweep.py --op hla2 --seq-len 16384 --skip-check --append --variants "" \
  "HILO_HLA=out_by=128,dvalues_bv=128" "HILO_HLA=dqk_bv=64" "HILO_HLA=dqk_bk=128,dvalues_bk=128,out_bk=128" \
  "HILO_HLA=scan_by=64" "HILO_HLA=scan_stages=3" "HILO_HLA=scan_warps=8" \
  > /tmp/o2.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o2.log | cut -c1-250 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el "hla2 at hla_mamba2 340m's heads (H = 32, K = 128, V = 64), 8K x 4: time and profile" | tee -a $L
timeout -k 20 90 python -u benchmarks/kernels.py --ops hla2 --seqlens 8192 --heads 32 --dim 128 --dim-v 64 --skip-check \
  --profile 8192 > /tmp/p2.log 2>&1; echo "rc=$?" >> $L; grep -vE "^\s*$|Warn|warn" /tmp/p2.log | tail -25 | cut -c1-200 >> $L
el done | tee -a $L
cat $L
