#!/bin/bash
# Planned second GPU call of the next session (<= 10 min): delta_rule launch variants with profiles, the HLA and
# log-linear models at 340m on the GPU (issue 4/5 "trains on GPU"; hla_mamba2 timed out compiling before the fp32
# linear_attn fix), and decoding at 1K / 32K. Training throughput (issue 7) needs its own call: `make bench`.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log2.txt
el "1. delta_rule variants" | tee -a $L
timeout 120 python benchmarks/delta_rule_variants.py --variants new new_state_fw8 new_prep_w8 new_grads_kb64 >> $L 2>&1
for m in hla_mamba2 loglinear_gated_deltanet "loglinear_gated_deltanet model.mixer_kwargs.backend=triton" \
         "hla_transformer model.mixer_kwargs.backend=fused"; do
  el "2. train $m" | tee -a $L
  timeout 100 python train.py model=$m model/size=340m trainer.max_steps=12 trainer.seq_len=2048 trainer.batch_size=4 \
    trainer.val_every=0 trainer.save_final=false trainer.log_every=4 trainer.progress_bar=false logger=none \
    name=smoke > /tmp/t.log 2>&1; echo "rc=$? $(tail -1 /tmp/t.log | cut -c1-160)" | tee -a $L
done
el "3. decode 1K / 32K" | tee -a $L
timeout 150 python benchmarks/decode.py --contexts 1024 32768 --families mamba2 loglinear_mamba2 gated_deltanet \
  loglinear_gated_deltanet hla_transformer --append >> $L 2>&1
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
tail -60 $L
