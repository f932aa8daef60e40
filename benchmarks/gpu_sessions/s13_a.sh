#!/bin/bash
# Planned first call of session 13 (nvidia-h200; carry .whl; <= 10 min): session 12 made HLA's chunk kernels 4 warps
# with 128-wide K loops and delta_rule's fused backward 4 warps / 3 stages the defaults; test_gpu_head_dims passed
# under each setting alone, but test_hla.py and test_delta_rule.py never finished on the GPU under them (s12_e.sh
# saw a block of failures that looked like a sticky CUDA fault in one worker; s12_g.sh hit its time limit). Each
# file here in its own pytest run (4 workers), the full log kept, the slowest tests listed.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
for spec in "test_delta_rule 200" "test_hla 330"; do
  set -- $spec
  el "$1 on the GPU under the defaults" | tee -a $L
  timeout -k 10 $2 python -m pytest -p no:logging -n 4 --tb=short --durations=12 tests/kernels/$1.py > $OUT/n/$1.txt 2>&1
  echo "rc=$?" >> $L; grep -E "^E |Error|passed|failed|^[0-9.]+s " $OUT/n/$1.txt | head -40 | cut -c1-250 >> $L
done
el done | tee -a $L
cat $L
