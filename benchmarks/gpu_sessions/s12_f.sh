#!/bin/bash
# Session 12, fourth call (nvidia-h200; carry .whl; <= 6 min): s12_e.sh's GPU tests under the fast launch settings
# failed at K = 64, V = 16 / 32 (hla2, ahla, delta_rule, loglinear_delta_rule), GDN's wide heads and fp32 wide
# heads (delta_rule). Which setting breaks what, and do they fail under the defaults too: each group's messages.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
W4=out_warps=4,dvalues_warps=4,dqk_warps=4; BK=out_bk=128,dvalues_bk=128,dqk_bk=128
group() { el "$1 :: -k $2" | tee -a $L; env $1 timeout -k 10 $3 python -m pytest -p no:logging -n 4 --tb=line \
  tests/kernels/test_gpu_head_dims.py -k "$2" > /tmp/t.log 2>&1; echo "rc=$?" >> $L
  grep -E "Error|passed|failed" /tmp/t.log | grep -v "^FAILED" | sort -u | tail -14 | cut -c1-300 >> $L; }
group HILO_HLA= "(64-16 or 64-32 or wide) and (hla2 or ahla or delta_rule)" 90
group HILO_HLA=$W4 "hla2 or ahla" 70
group HILO_HLA=$BK "hla2 or ahla" 70
group HILO_DELTA_RULE=grads_stages=3 "delta_rule and not loglinear" 60
group HILO_DELTA_RULE=grads_warps=4 "delta_rule and not loglinear" 60
el done | tee -a $L
cat $L
