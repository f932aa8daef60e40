#!/bin/bash
# Planned fourth call of session 19 (nvidia-h200; carry .whl; <= 9.5 min), if device time is left: issue 7's "760m at
# 16,384 trains in the GPU's memory with a 0.5M-token global batch via accumulation" for the families session 8
# (s8_x2a / s8_x2d) did not run: Transformer, Mamba-2, GDN and log-linear Mamba-2 passed there; here the three HLA
# Transformers, hla_mamba2 and the HLA GDN at 32 x 1 row of 16K accumulated (2 optimizer steps, compiled), then
# log-linear GDN with 2 rows accumulated (its 0.5M-token step would take ~100 s; memory is the micro-batch's, which
# accumulation does not change) as time allows. Peak memory is the table's column.
source benchmarks/gpu_sessions/lib.sh
for m in hla_transformer ahla_transformer hla3_transformer hla_mamba2 hla_gated_deltanet; do
  l=$(( $(left) - 5 )); [ "$l" -gt 60 ] || break
  throughput $(( l > 100 ? 100 : l )) "760m_$m" --sizes 760m --seq-lens 16384 --batch-size 1 --steps 2 --compile \
    --models "$m" trainer.grad_accum=32
done
l=$(( $(left) - 5 ))
[ "$l" -gt 60 ] && throughput "$l" 760m_loglinear_gated_deltanet --sizes 760m --seq-lens 16384 --batch-size 1 \
  --steps 2 --compile --models loglinear_gated_deltanet trainer.grad_accum=2
el done
cat "$L"
