#!/bin/bash
# Session 3, GPU call 4 (<= 9.5 min): where a 340m training step's time goes (mamba2 / GDN at half the Transformer's
# tokens/s), why loglinear GDN and hla_mamba2 ran out of memory at 32K tokens/step, HLA numerics in bf16 at 32K,
# and loglinear_attn's 16-bit level-scan dots (lowp) checked and timed. Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "1. step profiles" | tee -a $L
timeout 120 python benchmarks/step_profile.py --families mamba2 gated_deltanet transformer --seq-len 8192 --top 22 \
  > $OUT/n/step_profile.log 2>&1; echo "rc=$?" >> $L
timeout 70 python benchmarks/step_profile.py --families loglinear_gated_deltanet hla_mamba2 --seq-len 8192 \
  --tokens 8192 --top 22 >> $OUT/n/step_profile.log 2>&1; echo "rc=$?" >> $L
grep -E "^### |Error" $OUT/n/step_profile.log | tee -a $L
el "2. HLA numerics" | tee -a $L
timeout 120 python benchmarks/hla_numerics.py --normalize false --append > $OUT/n/hla_numerics.log 2>&1; echo "rc=$?" >> $L
timeout 50 python benchmarks/hla_numerics.py --normalize true --decays 0.99 --append >> $OUT/n/hla_numerics.log 2>&1; echo "rc=$?" >> $L
el "3. loglinear_attn lowp" | tee -a $L
for opt in "lowp=1" "lowp=1,scan_levels=4"; do
  HILO_LOGLINEAR=$opt timeout 60 python benchmarks/kernels.py --ops loglinear_attn --seqlens 1024 16384 \
    > /tmp/k.log 2>&1; echo "$opt rc=$?" >> $L; grep -E "^\| loglinear|^\| [0-9]+ .*loglinear" /tmp/k.log | grep -E "NO|^\| [0-9]" >> $L
done
HILO_LOGLINEAR=lowp=1 timeout 45 python -m pytest tests/kernels/test_gpu_head_dims.py -k "loglinear_attn" -o addopts="" -q \
  -p no:cacheprovider 2>&1 | tail -3 >> $L
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
cat $L
