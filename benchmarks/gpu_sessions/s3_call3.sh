#!/bin/bash
# Session 3, GPU call 3 (<= 9.8 min): issue 7's training-throughput grid at 340m, 32K tokens per step, before any
# compile work: the Transformer at 2K/8K/16K, every linear family at 8K/16K (each family's first run also shows it
# trains on the GPU). One process per group so a crash or timeout loses one group only. Carry .whl, .hilo_cache.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
grp() {  # limit_s, then train_throughput arguments
  local lim=$1; shift
  el "group: $*" | tee -a $L
  timeout $lim python benchmarks/train_throughput.py --steps 16 --append "$@" > /tmp/g.log 2>&1
  echo "rc=$?" | tee -a $L
  grep -E '^\{"model"' /tmp/g.log | python3 -c 'import sys,json
for l in sys.stdin:
  r=json.loads(l); print(r["model"],r["seq_len"],r["batch_size"],r.get("status"),round(r.get("tokens_per_s",0)),
    "mfu=%s"%(round(100*r["mfu"],1) if r.get("mfu") else None),"mem=%.1f"%r.get("mem_peak_gib",0),
    "ms=%.0f"%r.get("step_ms",0),"fwd=%.2f bwd=%.2f opt=%.2f data=%.2f"%tuple(r.get(k+"_frac",0) for k in ("forward","backward","optimizer","data_wait")))' | tee -a $L
  grep -E "Error|error:" /tmp/g.log | tail -3 | cut -c1-300 | tee -a $L
}
grp 150 --models transformer --seq-lens 2048 8192 16384
grp 150 --models mamba2 gated_deltanet --seq-lens 8192 16384
grp 140 --models loglinear_mamba2 loglinear_gated_deltanet --seq-lens 8192 16384
grp 140 --models hla_transformer hla_mamba2 hla_gated_deltanet --seq-lens 8192 16384
cp benchmarks/RESULTS.md $OUT/n/RESULTS.md
el done | tee -a $L
