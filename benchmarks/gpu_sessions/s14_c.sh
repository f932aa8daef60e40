#!/bin/bash
# Planned third call of session 14 (nvidia-h200; carry .whl; <= 9.5 min): the head-dim and bf16 GPU tests under
# session 13's defaults (_pass_dqk's 64-wide K loop; compose16's check), hla2's per-kernel profile, ahla under
# dqk_bk=64 against 128 with the bf16 check (s13_c2.sh's 50 s ran out in the check), then hla_mamba2's compiled 8K
# step (52,237 tokens/s in session 8; its hla2 went 17.2 -> 11.4 ms since) on the fused kernels and on the bf16
# composition (model.mixer_kwargs.backend=triton, HILO_HLA=compose16=1), if s14_a.sh found compose16 within the check.
source benchmarks/gpu_sessions/lib.sh
tests head_dims 200 8 tests/kernels/test_gpu_head_dims.py tests/kernels/test_gpu_bf16.py \
  -k "hla2 or ahla or delta_rule or compose16"
el "hla2 per-kernel profile at 16K x 2 (fused, defaults)"
timeout -s INT -k 10 60 python -u benchmarks/kernels.py --ops hla2 --seqlens 16384 --skip-check --profile 16384 \
  > "$OUT/n/hla2_profile.log" 2>&1; echo "rc=$?" >> "$L"
grep -E "^\| 16384|_state_scan|_chunk_out|_pass_d|GPU kernels" "$OUT/n/hla2_profile.log" | cut -c1-200 >> "$L"
sweep 110 ahla_dqk --op ahla --seq-len 16384 --variants "" "HILO_HLA=dqk_bk=128"
l=$(left); [ "$l" -gt 80 ] && throughput $(( l > 220 ? 220 : l )) hla_mamba2 --steps 12 --compile \
  --models hla_mamba2 --seq-lens 8192
l=$(left); [ "$l" -gt 80 ] && HILO_HLA=compose16=1 throughput "$l" hla_mamba2_c16 --steps 12 --compile \
  --models hla_mamba2 --seq-lens 8192 ++model.mixer_kwargs.backend=triton
el done
cat "$L"
