#!/bin/bash
# Session 16, last call (nvidia-h200; carry .whl; <= ~7.5 min). s16_d's profiles: segments cut the state kernels'
# time at 32K x 1, H = 4 (64 programs) from 1.15 to 0.31 ms but the call got slower (host: segment_gate_sums' torch
# ops), and at 256 programs (16K x 2, H = 16) they cost more GPU time (0.74 -> 0.84 ms). Now the gate sums come from
# the first launch and the rule (state_segments=0) segments only grids under one program a multiprocessor. Check
# (bf16 vs the fp32 oracle, 4 segments forced: T = 777 and packed documents) and time at few programs: 32K x 1 at
# H = 4 (64 programs; rule: 12 segments) and H = 8 (128; 6), 64K x 1 at H = 4 (12), hla2 32K x 1 at H = 4; then a
# profile of the rule at 32K, H = 4 (wall against kernel time).
BUDGET=${BUDGET:-450}
source benchmarks/gpu_sessions/lib.sh
sweep 80 h4 --op linear_attn --seq-len 32768 --heads 4 --variants "" "HILO_LINEAR_ATTN=state_segments=0" \
  "HILO_LINEAR_ATTN=state_segments=4"
sweep 50 h8 --op linear_attn --seq-len 32768 --heads 8 --skip-check --variants "" "HILO_LINEAR_ATTN=state_segments=0"
sweep 50 h4_64k --op linear_attn --seq-len 65536 --tokens 65536 --heads 4 --skip-check --variants "" \
  "HILO_LINEAR_ATTN=state_segments=0"
sweep 60 hla2_h4 --op hla2 --backend triton --seq-len 32768 --heads 4 --variants "" "HILO_LINEAR_ATTN=state_segments=0"
el "profile rule 32K H4"
HILO_LINEAR_ATTN=state_segments=0 timeout -s INT -k 10 50 python -u benchmarks/kernels.py --ops linear_attn \
  --skip-check --skip-bench --heads 4 --profile 32768 > "$OUT/n/prof_rule.log" 2>&1
echo "rc=$?" >> "$L"; grep -E "wall|_chunk|aten|void" "$OUT/n/prof_rule.log" | head -12 | cut -c1-200 >> "$L"
el done
cat "$L"
