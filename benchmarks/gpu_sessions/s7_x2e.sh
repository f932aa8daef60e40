#!/bin/bash
# Session 7, fifth call (carry .whl, .hilo_cache): the CUDA compile test after the norms' fix (compiled blocks run
# the norm formulas through autograd: torch 2.11 traced the norms' autograd.Functions into wrong gradients).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site HILO_CACHE=$PWD/.hilo_cache WANDB_MODE=disabled
( CUDA_VISIBLE_DEVICES=1 timeout 150 python -m pytest -q -p no:logging -rf tests/training/test_compile.py -k "cuda and (mamba2 or gated)" > /tmp/c1.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 timeout 150 python -m pytest -q -p no:logging -rf tests/training/test_compile.py -k "cuda and not mamba2 and not gated" > /tmp/c0.log 2>&1
wait
for f in /tmp/c0.log /tmp/c1.log; do grep -E "passed|failed|^FAILED|^E  " $f | tail -8 | cut -c1-300; done
