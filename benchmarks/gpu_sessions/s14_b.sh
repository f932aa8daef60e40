#!/bin/bash
# Planned second call of session 14 (nvidia-h200; carry .whl; <= 9.5 min): issue 7's nearest misses. Gated DeltaNet
# at 8K is 0.90x the Transformer (114,273 against 127,090 tokens/s, session 13): where its compiled step goes now
# (session 12's profile predates three kernel changes), then, compiled:
#  - HILO_SHORT_CONV_BWD=graph (session 13, CPU-tested: SiLU fused by inductor, no fp32 dpre pass; the short conv's
#    kernels were 26.8 ms of GDN's 306 kernel-ms) for GDN at 8K and Mamba-2 at 16K;
#  - Mamba-2 at 16K with the defaults first (121,478 in session 9; the target is 2x the Transformer's 91,343): since
#    session 13 its conv reads xBC, a column slice of in_proj's output, in place instead of copying it;
#  - model.fused_projections (CPU-tested since session 11, never timed) for GDN at 8K (its q, k, v slices now go into
#    the convs without a copy) and the Transformer at 2K (41.7% MFU against the 45% target).
source benchmarks/gpu_sessions/lib.sh
el "GDN 8K compiled step profile"
timeout -s INT -k 20 200 python -u benchmarks/step_profile.py --families gated_deltanet --seq-len 8192 --compile \
  > "$OUT/n/gdn_profile.log" 2>&1; echo "rc=$?" >> "$L"; head -40 "$OUT/n/gdn_profile.log" | cut -c1-200 >> "$L"
# GDN's training shape (8K x 4, H = 3, K = 256, V = 512: 12 sequence-head pairs) takes 32-wide V-blocks in the state
# passes (192 programs); 64-wide ones would be 96 programs with twice the work per [C, 256] key-tile load
sweep 40 gdn_bv --op delta_rule --seq-len 8192 --tokens 32768 --heads 3 --dim 256 --dim-v 512 --skip-check \
  --variants "" "HILO_DELTA_RULE=state_bv_min=64"
# each spec: name, model, T, HILO_SHORT_CONV_BWD, extra flag (- for none)
for spec in "gdn_graph gated_deltanet 8192 graph -" "gdn_fproj gated_deltanet 8192 split --fused-projections" \
            "m2 mamba2 16384 split -" "m2_graph mamba2 16384 graph -" \
            "tr_fproj transformer 2048 split --fused-projections"; do
  set -- $spec; l=$(left); [ "$l" -lt 80 ] && break
  extra=$5; [ "$5" = "-" ] && extra=""
  HILO_SHORT_CONV_BWD=$4 throughput $(( l > 150 ? 150 : l )) "$1" --steps 12 --compile $extra --models "$2" \
    --seq-lens "$3"
done
el done
cat "$L"
