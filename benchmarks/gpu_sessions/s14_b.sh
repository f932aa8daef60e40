#!/bin/bash
# Last call of session 14 (nvidia-h200; carry .whl; <= 9.5 min; run after s14_d.sh, trimmed to the device time left):
# issue 7's nearest misses. Gated DeltaNet at 8K is 0.90x the Transformer (114,273 against 127,090 tokens/s, s13).
# Compiled training for:
#  - delta_rule's state V-block 64 against 32 at GDN's training shape (8K x 4, H = 3, K = 256, V = 512: 12
#    sequence-head pairs, 192 programs at 32 wide; 64 wide is 96 programs with twice the work per key-tile load);
#  - HILO_SHORT_CONV_BWD=graph (session 13, CPU-tested: SiLU fused by inductor, no fp32 dpre pass; the short conv's
#    kernels were 26.8 ms of GDN's 306 kernel-ms in session 12's profile) for GDN at 8K and Mamba-2 at 16K (121,098
#    with the defaults in s14_d);
#  - model.fused_projections (CPU-tested since session 11, never timed) for GDN at 8K (its q, k, v slices now go
#    into the convs without a copy) and the Transformer at 2K (41.7% MFU against the 45% target);
#  - hla_transformer at 8K under the new bf16 hla2 default (compose16).
# (Session 13's plan also had GDN's compiled step profile: 200 s the budget no longer holds.)
source benchmarks/gpu_sessions/lib.sh
sweep 40 gdn_bv --op delta_rule --seq-len 8192 --tokens 32768 --heads 3 --dim 256 --dim-v 512 --skip-check \
  --variants "" "HILO_DELTA_RULE=state_bv_min=64"
# each spec: name, model, T, HILO_SHORT_CONV_BWD, extra flag (- for none)
for spec in "gdn_graph gated_deltanet 8192 graph -" "gdn_fproj gated_deltanet 8192 split --fused-projections" \
            "m2_graph mamba2 16384 graph -" "tr_fproj transformer 2048 split --fused-projections" \
            "hla_tr hla_transformer 8192 split -"; do
  set -- $spec; l=$(left); [ "$l" -lt 70 ] && break
  extra=$5; [ "$5" = "-" ] && extra=""
  HILO_SHORT_CONV_BWD=$4 throughput $(( l > 120 ? 120 : l )) "$1" --steps 12 --compile $extra --models "$2" \
    --seq-lens "$3"
done
el done
cat "$L"
