#!/bin/bash
# Session 3, GPU call 2 (<= 9 min): re-check the narrow-tile fixes (loglinear_attn intra V tile, delta_rule V < 64
# padding) and the fused HLA kernels at small heads; loglinear_delta_rule Triton vs torch timing; per-kernel profiles
# at T = 16K; 340m smoke runs of the HLA / log-linear presets; decoding at 1K / 32K. Carry .whl and .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. GPU tests at small heads, one process per case" | tee -a $L
python -m pytest tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py --collect-only -o addopts="" -q \
  -p no:cacheprovider 2>/dev/null | grep "::" | grep -E "loglinear_attn|-delta_rule\]|hla2|ahla" | grep -v wide > /tmp/ids.txt
wc -l < /tmp/ids.txt | tee -a $L
cat /tmp/ids.txt | xargs -P 16 -I{} sh -c 'timeout 150 python -m pytest "{}" -o addopts="" -q -p no:cacheprovider \
  > /tmp/one.$$.log 2>&1 && echo "PASS {}" || echo "FAIL {} :: $(grep -E "^E " /tmp/one.$$.log | head -2 | tr "\n" " " | cut -c1-200)"' \
  | sed 's#tests/kernels/##' | sort >> $L
echo "passed $(grep -c PASS $L)"; grep FAIL $L
el "2. 340m smoke runs (parallel)" | tee -a $L
i=0
for m in hla_mamba2 hla_transformer "loglinear_gated_deltanet model.mixer_kwargs.backend=triton" loglinear_mamba2 ahla_transformer; do
  i=$((i+1))
  (timeout 200 python train.py model=$m model/size=340m trainer.max_steps=12 trainer.seq_len=2048 trainer.batch_size=4 \
    trainer.val_every=0 trainer.save_final=false trainer.log_every=4 trainer.progress_bar=false logger=none \
    name=smoke$i > /tmp/t$i.log 2>&1; echo "train $m rc=$? :: $(grep -E "step +12|Error|error" /tmp/t$i.log | tail -2 | cut -c1-220)" >> $L) &
done
el "3. kernel timings and profiles (while the smoke runs train)" | tee -a $L
timeout 200 python benchmarks/kernels.py --ops loglinear_delta_rule --also-backends torch --skip-check \
  --seqlens 4096 16384 --append > $OUT/n/k_lldr.log 2>&1; echo "lldr rc=$?" >> $L
timeout 200 python benchmarks/kernels.py --ops loglinear_attn loglinear_delta_rule hla2 delta_rule --skip-check \
  --skip-bench --profile 16384 > $OUT/n/profile.log 2>&1; echo "profile rc=$?" >> $L
wait
el "4. decode 1K / 32K" | tee -a $L
timeout 170 python benchmarks/decode.py --contexts 1024 32768 --families mamba2 loglinear_mamba2 gated_deltanet \
  loglinear_gated_deltanet hla_transformer transformer --append > $OUT/n/decode.log 2>&1; echo "decode rc=$?" >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L; grep -E "^\|" $OUT/n/k_lldr.log | tail -8; tail -25 $OUT/n/decode.log
