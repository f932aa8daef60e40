#!/bin/bash
# Session 12, fifth call (nvidia-h200; carry .whl; <= 8 min): the new defaults (HLA chunk kernels at 4 warps with
# 128-wide K loops; delta_rule's fused backward at 4 warps, 3 stages) through the GPU tests of both operators (one
# file per pytest worker so a sticky CUDA fault stays in its file), then their timing under the defaults.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "GPU tests under the new defaults" | tee -a $L
timeout -k 10 330 python -m pytest -p no:logging -n 4 --dist loadfile --tb=line tests/kernels/test_hla.py \
  tests/kernels/test_delta_rule.py tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py \
  -k "hla or ahla or (delta_rule and not loglinear)" > /tmp/t.log 2>&1; echo "rc=$?" >> $L
grep -E "Error|passed|failed" /tmp/t.log | sort -u | tail -25 | cut -c1-300 >> $L
el "timing under the defaults" | tee -a $L
for a in "--op hla2 --seq-len 16384" "--op ahla --seq-len 16384" "--op delta_rule --seq-len 16384 --heads 3 --dim 256 --dim-v 512"; do
  timeout -k 10 60 python -u benchmarks/option_sweep.py --append $a --variants "" > /tmp/o.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done | tee -a $L
cat $L
