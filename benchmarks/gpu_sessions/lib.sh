#!/bin/bash
# Shared by the GPU session scripts (source it first; from session 14 on). On the device machine: installs the
# carried wheelhouse (.whl: hydra-core, omegaconf, datasets), turns W&B off, and defines
#   el MSG                       print MSG with the seconds since the script started
#   left                         seconds left of the call's budget (BUDGET, default 555)
#   tests NAME SECONDS WORKERS ARGS...   pytest ARGS under xdist, its whole log in $OUT/n/NAME.txt, the verdict lines
#                                in the log. addopts are cleared (the pyproject's -q would cancel -v) and the time
#                                limit sends SIGINT first, so pytest still prints the failures it has.
#   sweep SECONDS NAME ARGS...   benchmarks/option_sweep.py --append ARGS, its log in $OUT/n/sweep_NAME.log
#   throughput SECONDS NAME ARGS...  benchmarks/train_throughput.py --append ARGS (HILO_* set by the caller)
#   profile SECONDS FAMILY T ARGS...  benchmarks/step_profile.py of the compiled 340m FAMILY at T (its log in
#                                $OUT/n/prof_FAMILY_T.log, the table in the log)
# Everything is logged to $L ($OUT/n/log.txt), and RESULTS.md is copied to $OUT/n after each appending step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s)
BUDGET=${BUDGET:-555}
mkdir -p "$OUT/n"
L=$OUT/n/log.txt
el() { echo "[+$(( $(date +%s) - T0 ))s] $*" >> "$L"; }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
tests() {
  local name=$1 secs=$2 workers=$3; shift 3
  el "start tests $name (${secs}s)"
  timeout -s INT -k 30 "$secs" python -m pytest -o addopts="" -p no:logging -n "$workers" -v -ra --tb=short \
    --durations=5 "$@" > "$OUT/n/$name.txt" 2>&1
  echo "$name rc=$?" >> "$L"
  grep -E "FAILED|^E  |[0-9]+ (passed|failed)" "$OUT/n/$name.txt" | head -12 | cut -c1-220 >> "$L"
}
sweep() {
  local secs=$1 name=$2; shift 2
  el "sweep $name (${secs}s)"
  timeout -s INT -k 10 "$secs" python -u benchmarks/option_sweep.py --append "$@" > "$OUT/n/sweep_$name.log" 2>&1
  echo "rc=$?" >> "$L"
  grep -E "^\| |Error" "$OUT/n/sweep_$name.log" | cut -c1-250 >> "$L"
  cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
}
throughput() {
  local secs=$1 name=$2; shift 2
  el "throughput $name (${secs}s)"
  timeout -s INT -k 10 "$secs" python -u benchmarks/train_throughput.py --append "$@" > "$OUT/n/$name.log" 2>&1
  echo "rc=$?" >> "$L"
  grep -E "^\| [a-z_0-9]+ \| |Error" "$OUT/n/$name.log" | grep -v "^| model" | tail -3 | cut -c1-250 >> "$L"
  cp benchmarks/RESULTS.md "$OUT/n/RESULTS.md"
}
profile() {
  local secs=$1 family=$2 t=$3; shift 3
  el "step_profile $family $t (${secs}s)"
  timeout -s INT -k 10 "$secs" python -u benchmarks/step_profile.py --families "$family" --seq-len "$t" --compile \
    --top 14 "$@" > "$OUT/n/prof_${family}_$t.log" 2>&1
  echo "rc=$?" >> "$L"; grep -vE "^\s*$|USDT" "$OUT/n/prof_${family}_$t.log" | tail -18 | cut -c1-170 >> "$L"
}
