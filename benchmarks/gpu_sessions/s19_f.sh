#!/bin/bash
# Sixth call of session 19 (nvidia-h200; carry .whl; run with BUDGET=190): s19_e's two rows with the defaults, the
# same session's baseline for its two options.
source benchmarks/gpu_sessions/lib.sh
throughput 90 hla_gdn_8192_base --steps 10 --compile --models hla_gated_deltanet --seq-lens 8192
l=$(( $(left) - 5 ))
[ "$l" -gt 60 ] && throughput "$l" llm2_8192_base --steps 10 --compile --models loglinear_mamba2 --seq-lens 8192
el done
cat "$L"
