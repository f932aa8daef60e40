#!/bin/bash
# Session 13, third call (nvidia-h200; carry .whl; <= 9.5 min; the last of the session's device time). s13_a2.sh found
# one failing GPU test, test_delta_rule.py::test_triton_fp16_paths[opts2] (an illegal memory access, sticky: the
# worker's later tests failed with it; the same explains s12_e.sh's block). First which kernel faults
# (s13_diag_delta.py), then the most useful of s13_b.sh / s13_c.sh: hla2's 16-bit state / mid-token storage and
# dqk_bk=64 with the bf16 check, GDN's compiled 8K training step under session 12's defaults, and delta_rule's
# state-pass warps at GDN's heads.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
sweep() { timeout -k 20 $1 python -u benchmarks/option_sweep.py --append "${@:2}" > $OUT/n/sweep_$3_$5.log 2>&1
  echo "rc=$?" >> $L; grep -E "^\| |Error" $OUT/n/sweep_$3_$5.log | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md; }
el "delta_rule fault diagnosis" >> $L
timeout -k 10 150 python -u benchmarks/gpu_sessions/s13_diag_delta.py > $OUT/n/diag.txt 2>&1; echo "rc=$?" >> $L
cat $OUT/n/diag.txt >> $L
el "hla2 16K x 2" >> $L
sweep 170 --op hla2 --seq-len 16384 --variants "" "HILO_HLA=states16=1" "HILO_HLA=states16=1,mid16=1" \
  "HILO_HLA=dqk_bk=64" "HILO_HLA=states16=1,mid16=1,dqk_bk=64" "HILO_HLA=out_persist=2,dvalues_persist=2"
left=$(( 545 - $(date +%s) + T0 )); el "GDN 8K compiled (${left}s left)" >> $L
timeout -k 20 $(( left > 200 ? 200 : left )) python -u benchmarks/train_throughput.py --steps 12 --compile \
  --append --models gated_deltanet --seq-lens 8192 > $OUT/n/gdn.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| gated_deltanet |Error" $OUT/n/gdn.log | tail -3 | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
left=$(( 545 - $(date +%s) + T0 )); el "delta_rule state passes (${left}s left)" >> $L
[ $left -gt 40 ] && sweep $left --op delta_rule --seq-len 16384 --heads 3 --dim 256 --dim-v 512 --skip-check --variants "" \
  "HILO_DELTA_RULE=state_warps=8" "HILO_DELTA_RULE=state_bwd_warps=4" "HILO_DELTA_RULE=state_bv_min=32"
el done >> $L
cat $L
