#!/bin/bash
# Planned second call of session 9 (nvidia-h200-x2; carry .whl, .hilo_cache; <= 10 min).
#  GPU 0: session 8's fused-HLA custom op (hilo::hla_fused: compiled HLA blocks without a graph break), written on
#         the CPU: the CUDA compile test (hla_transformer added), hla2 / ahla bf16 checks, then compiled throughput of
#         the HLA shells (session 8, with the graph break: hla_transformer 16K 119,211; hla_mamba2 52,237 / 51,919;
#         hla_gated_deltanet 63,774 / 59,570 tokens/s at 8K / 16K).
#  GPU 1: compiled decoding at 1K and 32K (issue 7's latency ratios), one family per process (session 8's two-family
#         run spent its 170 s compiling): gated_deltanet, loglinear_mamba2, hla_transformer, transformer.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt; L1=$OUT/n/log1.txt
( export CUDA_VISIBLE_DEVICES=1
  for fam in gated_deltanet loglinear_mamba2 hla_transformer transformer; do
    el "compiled decoding $fam 1K 32K" >> $L1
    timeout 140 python -u benchmarks/decode.py --contexts 1024 32768 --families $fam --compile-decoding --append \
      > /tmp/dc.log 2>&1; echo "rc=$?" >> $L1
    grep -E "^\| $fam |^- |Error" /tmp/dc.log | sort -u | cut -c1-250 >> $L1
  done ) &
BG=$!
export CUDA_VISIBLE_DEVICES=0
el "CUDA compile test" | tee -a $L
timeout 150 python -m pytest -p no:logging -rf tests/training/test_compile.py -k cuda > /tmp/ct.log 2>&1
echo "rc=$?" >> $L; grep -E "passed|failed|^FAILED|^E  " /tmp/ct.log | tail -10 | cut -c1-300 >> $L
el "kernels.py hla2 ahla 16K" | tee -a $L
timeout 80 python -u benchmarks/kernels.py --ops hla2 ahla --seqlens 16384 > /tmp/k.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| 16384 \|| NO \|$" /tmp/k.log | grep -v compose | cut -c1-200 >> $L
for ms in "hla_transformer 8192" "hla_transformer 16384" "hla_mamba2 16384" "hla_gated_deltanet 16384"; do
  set -- $ms; el "compiled $1 $2" | tee -a $L
  timeout 75 python -u benchmarks/train_throughput.py --steps 10 --compile --append --models $1 --seq-lens $2 \
    > /tmp/c.log 2>&1; echo "rc=$?" >> $L; grep -E "^\| $1 " /tmp/c.log | head -1 >> $L
done
wait $BG; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L $L1
