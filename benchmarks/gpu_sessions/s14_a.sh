#!/bin/bash
# Planned first call of session 14 (nvidia-h200; carry .whl; <= 9.5 min).
# 1. HILO_HLA=compose16=1 (session 13, CPU-tested in fp16): the HLA compositions over linear_attn run their passes in
#    bf16, K~ / V~ rounded between them, as fla's two-pass hla2 does (SPEC §9: 5.22 ms at 16K; our linear_attn is
#    2.07 ms there against fla's 2.69, so two passes may beat the fused hla2's 7.10 ms). float64 emulation on CPU:
#    the bf16 error ratio of o and every gradient goes 1.65e-3 -> 2.1-2.35e-3 from that rounding, at 4K and 16K.
#    hla2, ahla, hla3 (composition only: its fp32 passes are 100x slower) with the bf16 check, then hla2 at
#    hla_mamba2's heads (fused: 11.38 ms).
# 2. GPU tests of what session 13 changed, side by side (SIGINT at the limit, so pytest prints what failed; addopts
#    cleared, so -v works): test_delta_rule.py (K padding, state V-block floor) and test_short_conv.py (strided
#    inputs read in place, the graph form). The head-dim tests (_pass_dqk's 64-wide K loop) open s14_c.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( 555 - $(date +%s) + T0 )); }
mkdir -p $OUT/n; L=$OUT/n/log.txt
tests() {  # name, seconds, workers, pytest arguments
  el "start $1" >> $L
  timeout -s INT -k 30 $2 python -m pytest -o addopts="" -p no:logging -n $3 -v -ra --tb=short --durations=5 \
    "${@:4}" > $OUT/n/$1.txt 2>&1
  echo "$1 rc=$?" >> $L; grep -E "FAILED|^E  |[0-9]+ (passed|failed)" $OUT/n/$1.txt | head -12 | cut -c1-220 >> $L
}
sweep() {  # seconds, log name, option_sweep arguments
  timeout -s INT -k 10 $1 python -u benchmarks/option_sweep.py --append "${@:3}" > $OUT/n/sweep_$2.log 2>&1
  echo "rc=$?" >> $L; grep -E "^\| |Error" $OUT/n/sweep_$2.log | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md; }
el "compose16: hla2, ahla, hla3 at 16K x 2 (bf16 check)" >> $L
sweep 90 hla2 --op hla2 --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 80 ahla --op ahla --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 90 hla3 --op hla3 --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 40 hla2_m2 --op hla2 --backend triton --seq-len 8192 --tokens 32768 --heads 32 --dim 128 --dim-v 64 --skip-check \
  --variants "HILO_HLA=compose16=1"
l=$(( $(left) - 20 )); el "tests (${l}s)" >> $L
( tests delta_rule $l 8 tests/kernels/test_delta_rule.py ) &
tests short_conv $(( l < 150 ? l : 150 )) 4 tests/kernels/test_short_conv.py
wait
el done >> $L
cat $L
