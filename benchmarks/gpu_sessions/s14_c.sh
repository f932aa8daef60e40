#!/bin/bash
# Planned third call of session 14 (nvidia-h200; carry .whl; <= 9.5 min): the head-dim GPU tests under session 13's
# defaults (_pass_dqk's 64-wide K loop), ahla under dqk_bk=64 against 128 with the
# bf16 check (s13_c2.sh's 50 s ran out in the check), then hla_mamba2's compiled 8K step (52,237 tokens/s in session 8;
# its hla2 went 17.2 -> 11.4 ms since) on the fused kernels and, if s14_a.sh found compose16 faster and within the
# check, on the bf16 composition (model.mixer_kwargs.backend=triton, HILO_HLA=compose16=1).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( 555 - $(date +%s) + T0 )); }
mkdir -p $OUT/n; L=$OUT/n/log.txt
el "head-dim and bf16 GPU tests of hla2 / ahla / delta_rule" >> $L
timeout -s INT -k 30 200 python -m pytest -o addopts="" -p no:logging -n 8 -v -ra --tb=short \
  tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py -k "hla2 or ahla or delta_rule or compose16" \
  > $OUT/n/head_dims.txt 2>&1
echo "rc=$?" >> $L; grep -E "FAILED|^E  |[0-9]+ (passed|failed)" $OUT/n/head_dims.txt | head -12 | cut -c1-220 >> $L
el "hla2 per-kernel profile at 16K x 2 (fused, defaults)" >> $L
timeout -s INT -k 10 60 python -u benchmarks/kernels.py --ops hla2 --seqlens 16384 --skip-check --profile 16384 \
  > $OUT/n/hla2_profile.log 2>&1; echo "rc=$?" >> $L
grep -E "^\| 16384|_state_scan|_chunk_out|_pass_d|GPU kernels" $OUT/n/hla2_profile.log | cut -c1-200 >> $L
el "ahla dqk_bk (bf16 check)" >> $L
timeout -s INT -k 10 110 python -u benchmarks/option_sweep.py --append --op ahla --seq-len 16384 \
  --variants "" "HILO_HLA=dqk_bk=128" > $OUT/n/sweep_ahla.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| |Error" $OUT/n/sweep_ahla.log | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
for spec in "- -" "compose16=1 ++model.mixer_kwargs.backend=triton"; do
  set -- $spec; l=$(left); [ $l -lt 80 ] && break
  hla=$1; [ "$1" = "-" ] && hla=""; extra=$2; [ "$2" = "-" ] && extra=""
  el "hla_mamba2 8K compiled HILO_HLA=$hla $extra (${l}s)" >> $L
  HILO_HLA=$hla timeout -s INT -k 10 $(( l > 220 ? 220 : l )) python -u benchmarks/train_throughput.py --steps 12 \
    --compile --append --models hla_mamba2 --seq-lens 8192 $extra > $OUT/n/hla_mamba2_$1.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| hla_mamba2 |Error" $OUT/n/hla_mamba2_$1.log | tail -3 | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
done
el done >> $L
cat $L
