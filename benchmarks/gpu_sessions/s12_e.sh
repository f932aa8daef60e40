#!/bin/bash
# Session 12, third call (nvidia-h200; carry .whl; <= 10 min): s12_a.sh found 4 warps (8.37 ms against 10.36), a
# 128-register cap (8.70) and 128-wide K loops (8.80) each faster for hla2's chunk kernels at 16K; s12_b.sh found
# 3 stages (5.62 ms against 6.42), 4 warps (5.91) and a 128-register cap (6.07) each faster for delta_rule's fused
# backward at GDN heads. Here their combinations, at more shapes, then the GPU tests under the leading candidates.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
sweep() { timeout -k 20 $1 python -u benchmarks/option_sweep.py --skip-check --append "${@:2}" > /tmp/o.log 2>&1
  echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md; }
W4=out_warps=4,dvalues_warps=4,dqk_warps=4; BK=out_bk=128,dvalues_bk=128,dqk_bk=128
el "hla2 16K x 2, H16 D128: combinations" | tee -a $L
sweep 120 --op hla2 --seq-len 16384 --variants "" "HILO_HLA=$W4" "HILO_HLA=$W4,$BK" "HILO_HLA=$W4,dqk_bv=64" \
  "HILO_HLA=$W4,out_maxnreg=128,dvalues_maxnreg=128,dqk_maxnreg=128" "HILO_HLA=out_warps=4" "HILO_HLA=dvalues_warps=4" \
  "HILO_HLA=dqk_warps=4" "HILO_HLA=$W4,out_stages=3,dvalues_stages=3,dqk_stages=3" "HILO_HLA=$W4,$BK,dqk_bv=64"
el "ahla 16K x 2" | tee -a $L
sweep 60 --op ahla --seq-len 16384 --variants "" "HILO_HLA=$W4" "HILO_HLA=$W4,$BK"
el "hla2 at hla_mamba2 340m's heads, 8K x 4, H32 K128 V64" | tee -a $L
sweep 60 --op hla2 --seq-len 8192 --tokens 32768 --heads 32 --dim 128 --dim-v 64 --variants "" "HILO_HLA=$W4" \
  "HILO_HLA=$W4,$BK"
el "delta_rule at GDN heads (H3 K256 V512) 16K x 2" | tee -a $L
sweep 90 --op delta_rule --seq-len 16384 --heads 3 --dim 256 --dim-v 512 --variants "" "HILO_DELTA_RULE=grads_stages=3" \
  "HILO_DELTA_RULE=grads_stages=3,grads_warps=4" "HILO_DELTA_RULE=grads_stages=3,grads_maxnreg=128" \
  "HILO_DELTA_RULE=grads_stages=4"
el "delta_rule H16 K128 V128 16K x 2" | tee -a $L
sweep 60 --op delta_rule --seq-len 16384 --variants "" "HILO_DELTA_RULE=grads_stages=3" \
  "HILO_DELTA_RULE=grads_stages=3,grads_warps=4" "HILO_DELTA_RULE=grads_warps=4"
left=$(( 560 - $(date +%s) + T0 )); el "GPU tests under HILO_HLA=$W4,$BK and grads_stages=3 (${left}s)" | tee -a $L
HILO_HLA=$W4,$BK HILO_DELTA_RULE=grads_stages=3 timeout -k 10 $left python -m pytest -p no:logging -rf -n 4 \
  tests/kernels/test_hla.py tests/kernels/test_delta_rule.py tests/kernels/test_gpu_head_dims.py \
  tests/kernels/test_gpu_bf16.py -k "hla or delta_rule" > /tmp/t.log 2>&1; echo "rc=$?" >> $L
grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/t.log | sort -u | tail -12 | cut -c1-240 >> $L
el done | tee -a $L
cat $L
