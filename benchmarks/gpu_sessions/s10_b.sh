#!/bin/bash
# Planned second call of session 10 (nvidia-h200; carry .whl, .hilo_cache; <= 10 min): issue 5's fused hla2 with bf16
# operands in its state scans only (HILO_HLA=lowp_scan=1: within SPEC's bf16 tolerances for hla2 in session 9's CPU
# emulation, where lowp=1 was 1.3e-2), checked and timed at 4K / 16K against the default (tf32) and lowp=1
# (session 8: 10.4 / 6.0 ms at 16K); the fused HLA GPU tests with lowp_scan=1 (narrow tiles: K = 32, V = 64 gave
# error ratios of 7-22 with lowp=1 on the H200); the short conv's bf16 GPU tests with the new 64x64 tiles.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
for opt in "" "lowp_scan=1" "lowp=1"; do
  el "kernels.py hla2 ahla HILO_HLA=$opt" | tee -a $L
  HILO_HLA=$opt timeout 90 python -u benchmarks/kernels.py --ops hla2 ahla --seqlens 4096 16384 --append > /tmp/k.log 2>&1
  echo "rc=$?" >> $L; grep -E "^\| [0-9]+ \|| NO \|$|Error" /tmp/k.log | grep -v compose | cut -c1-200 >> $L
done
el "fused HLA GPU tests, lowp_scan=1" | tee -a $L
HILO_HLA=lowp_scan=1 timeout 150 python -m pytest -p no:logging -rf -n 6 tests/kernels/test_gpu_head_dims.py \
  tests/kernels/test_gpu_bf16.py tests/kernels/test_hla.py -k "hla or ahla" > /tmp/g.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  +[A-Za-z.]*Error" /tmp/g.log | sort -u | tail -12 | cut -c1-240 >> $L
el "short conv GPU tests" | tee -a $L
timeout 100 python -m pytest -p no:logging -rf tests/kernels/test_short_conv.py > /tmp/s.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/s.log | tail -6 | cut -c1-240 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
