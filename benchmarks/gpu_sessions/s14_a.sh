#!/bin/bash
# Planned first call of session 14 (nvidia-h200; carry .whl; <= 9.5 min). Session 13 changed three defaults after
# measuring them: delta_rule's state passes keep V-blocks >= 32 past K = 128, the two-kernel 16-bit delta_rule
# backward pads K to 64 on CUDA, and _pass_dqk loops K 64 wide. First the GPU tests that run those kernels, each file
# in its own pytest (SIGINT at the limit, so pytest prints what failed; addopts cleared, so -v works), two files side
# by side on the 16 cores. Then ahla under dqk_bk=64 against 128 with the bf16 check (s13_c2.sh's 50 s ran out in
# the check), and hla_mamba2's compiled 8K step (52,237 tokens/s in session 8; its hla2 went 17.2 -> 11.4 ms since).
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
sweep() { timeout -s INT -k 10 $1 python -u benchmarks/option_sweep.py --append "${@:2}" > $OUT/n/sweep_$3_$5.log 2>&1
  echo "rc=$?" >> $L; grep -E "^\| |Error" $OUT/n/sweep_$3_$5.log | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md; }
( tests delta_rule 300 6 tests/kernels/test_delta_rule.py ) &
tests head_dims 300 8 tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py \
  -k "hla2 or ahla or delta_rule"
wait
el "ahla dqk_bk (bf16 check)" >> $L
sweep 110 --op ahla --seq-len 16384 --variants "" "HILO_HLA=dqk_bk=128"
l=$(left); el "hla_mamba2 8K compiled (${l}s left)" >> $L
[ $l -gt 80 ] && { timeout -s INT -k 5 $l python -u benchmarks/train_throughput.py --steps 12 --compile \
  --append --models hla_mamba2 --seq-lens 8192 > $OUT/n/hla_mamba2.log 2>&1; echo "rc=$?" >> $L
  grep -E "^\| hla_mamba2 |Error" $OUT/n/hla_mamba2.log | tail -3 | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md; }
el done >> $L
cat $L
