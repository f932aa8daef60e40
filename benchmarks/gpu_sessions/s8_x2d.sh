#!/bin/bash
# Planned fourth call of session 8 (nvidia-h200-x2; carry .whl, .hilo_cache; <= 10 min): issue 5's fused hla2 / ahla
# with HILO_HLA=lowp=1 (bf16 dot operands instead of tf32 products of fp32 tiles; never measured), against the
# default, and its bf16 GPU tests; issue 7's 760m at 16K for the other families (s8_x2a did transformer, mamba2).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt; L1=/tmp/gpu1.txt
( export CUDA_VISIBLE_DEVICES=1
  el "bf16 GPU tests of hla2 / ahla, HILO_HLA=lowp=1" >> $L1
  HILO_HLA=lowp=1 timeout 200 python -m pytest -p no:logging -rf -n 6 tests/kernels/test_gpu_bf16.py \
    tests/kernels/test_gpu_head_dims.py -k "hla2 or ahla" > /tmp/t.log 2>&1
  echo "rc=$?" >> $L1; grep -E "passed|failed|^FAILED|^E  " /tmp/t.log | tail -8 | cut -c1-250 >> $L1
  for m in gated_deltanet loglinear_mamba2; do
    el "760m 16K 32x1 $m" >> $L1
    timeout 120 python -u benchmarks/train_throughput.py --sizes 760m --seq-lens 16384 --batch-size 1 --steps 3 \
      --compile --models $m trainer.grad_accum=32 > /tmp/b_$m.log 2>&1
    echo "rc=$?" >> $L1; grep -E "^\| $m " /tmp/b_$m.log >> $L1; grep -E "Error|OOM" /tmp/b_$m.log | tail -2 | cut -c1-250 >> $L1
  done ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
for opt in "" "lowp=1"; do
  el "kernels.py hla2 ahla, HILO_HLA=$opt" | tee -a $L
  HILO_HLA=$opt timeout 200 python -u benchmarks/kernels.py --ops hla2 ahla --seqlens 2048 4096 16384 --append \
    > /tmp/k.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| [0-9]+ \||FAIL|ERROR|> " /tmp/k.log | head -24 | cut -c1-200 >> $L
  cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
wait $BG; cat $L1 >> $L
el done | tee -a $L
cat $L
