#!/bin/bash
# Planned first call of session 14 (nvidia-h200; carry .whl; <= 9.5 min).
# 1. HILO_HLA=compose16=1 (session 13, CPU-tested): the HLA compositions over linear_attn run their passes in bf16,
#    K~ / V~ rounded between them, as fla's two-pass hla2 does (SPEC §9: 5.22 ms at 16K; our linear_attn is 2.07 ms
#    there against fla's 2.69, so two passes may beat the fused hla2's 7.10 ms). float64 emulation on CPU
#    (benchmarks/hla_compose_rounding.py): the bf16 error ratio of o and every gradient goes 1.65e-3 -> 2.1-2.35e-3
#    from that rounding, at 4K and 16K. hla2, ahla, hla3 (composition only: its fp32 passes are 100x slower) with
#    the bf16 check, then hla2 at hla_mamba2's heads (fused: 11.38 ms).
# 2. GPU tests of what session 13 changed, side by side: test_delta_rule.py (K padding, state V-block floor) and
#    test_short_conv.py (strided inputs read in place, the graph form). The head-dim tests open s14_c.sh.
source benchmarks/gpu_sessions/lib.sh
el "compose16: hla2, ahla, hla3 at 16K x 2 (bf16 check)"
sweep 90 hla2 --op hla2 --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 80 ahla --op ahla --backend triton --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 90 hla3 --op hla3 --seq-len 16384 --variants "HILO_HLA=compose16=1"
sweep 40 hla2_m2 --op hla2 --backend triton --seq-len 8192 --tokens 32768 --heads 32 --dim 128 --dim-v 64 --skip-check \
  --variants "HILO_HLA=compose16=1"
l=$(( $(left) - 20 ))
if [ "$l" -gt 60 ]; then
  ( tests delta_rule $l 8 tests/kernels/test_delta_rule.py ) &
  tests short_conv $(( l < 150 ? l : 150 )) 4 tests/kernels/test_short_conv.py
  wait
fi
el done
cat "$L"
