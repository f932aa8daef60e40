#!/bin/bash
# Planned second call of session 13 (nvidia-h200; carry .whl; <= 8 min): hla2 under session 12's defaults (7.59 ms
# fwd+bwd at 16K x 2, H = 16, D = 128): its per-kernel profile, then what is left to try on its kernels:
#  - states16=1 (session 12, CPU-tested): per-chunk states as scaled fp16, half the bytes the scans write and the
#    chunk kernels read (3.2 of the 12.9 GB a fwd+bwd moves at its byte floor, RESULTS.md);
#  - mid16=1 (session 12, CPU-tested): the inner pass's output K~ / V~ as scaled fp16 too (the byte floor with both:
#    9.0 GB, 2.14 ms at 4.2 TB/s, against 12.9 GB and 3.07 ms with neither);
#  - dqk_bk=64: _pass_dqk at 4 warps with 128-wide K loops takes 255 registers and spills 744-848 B (AOT, sm_90,
#    Triton 3.6); at 64 it takes 238-242 and spills nothing;
#  - out_bk=64 / dvalues_bk=64 for the other chunk kernels (the inner _chunk_out takes 242 registers at 128);
#  - out_persist / dvalues_persist (session 12, CPU-tested): each program takes 2 or 4 chunks in a loop pipelined
#    over 2 stages, the next chunk's tiles loading during this one's products (AOT: 140-189 KB of shared memory,
#    one program an SM; with 3 stages they would not fit);
#  - scan_by=16: twice the scan programs.
# Then ahla and hla2 at hla_mamba2's heads with the leaders, and delta_rule's state-pass warps (new options) at GDN's
# heads. (s12_c.sh, log-linear GDN's operator options, waits for a later call: its target is out of reach by
# arithmetic, RESULTS.md.)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site WANDB_MODE=disabled
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p $OUT/n; L=$OUT/n/log.txt
sweep() { timeout -k 20 $1 python -u benchmarks/option_sweep.py --append "${@:2}" > /tmp/o.log 2>&1
  echo "rc=$?" >> $L; grep -E "^\| |Error" /tmp/o.log | cut -c1-250 >> $L; cp benchmarks/RESULTS.md $OUT/n/RESULTS.md; }
el "hla2 profile at 16K x 2 under the defaults" | tee -a $L
timeout -k 10 60 python -u benchmarks/kernels.py --ops hla2 --seqlens 16384 --skip-check --profile 16384 > /tmp/p.log 2>&1
echo "rc=$?" >> $L; grep -E "^\| 16384|_state_scan|_chunk_out|_pass_d|GPU kernels" /tmp/p.log | cut -c1-200 >> $L
el "hla2 16K x 2: states16 and narrower K loops (bf16 check on)" | tee -a $L
sweep 220 --op hla2 --seq-len 16384 --variants "" "HILO_HLA=states16=1" "HILO_HLA=states16=1,mid16=1" \
  "HILO_HLA=dqk_bk=64" "HILO_HLA=states16=1,mid16=1,dqk_bk=64" "HILO_HLA=out_bk=64" "HILO_HLA=dvalues_bk=64" \
  "HILO_HLA=scan_by=16" \
  "HILO_HLA=out_persist=2,dvalues_persist=2" "HILO_HLA=out_persist=4,dvalues_persist=4"
el "ahla 16K x 2 and hla2 at hla_mamba2's heads" | tee -a $L
sweep 90 --op ahla --seq-len 16384 --variants "" "HILO_HLA=states16=1" "HILO_HLA=states16=1,mid16=1" \
  "HILO_HLA=states16=1,mid16=1,dqk_bk=64"
sweep 70 --op hla2 --seq-len 8192 --tokens 32768 --heads 32 --dim 128 --dim-v 64 --skip-check --variants "" \
  "HILO_HLA=states16=1,mid16=1" "HILO_HLA=states16=1,mid16=1,dqk_bk=64"
el "delta_rule's state passes at GDN 340m's heads (AOT at BV = 64: the forward pass spills 248 B at 4 warps, none at 8)" | tee -a $L
sweep 70 --op delta_rule --seq-len 16384 --heads 3 --dim 256 --dim-v 512 --skip-check --variants "" \
  "HILO_DELTA_RULE=state_warps=8" "HILO_DELTA_RULE=state_bwd_warps=4" "HILO_DELTA_RULE=state_bv_min=32"
el done | tee -a $L
cat $L
