#!/bin/bash
# Multi-GPU efficiency of one model (docs/distributed.md): two one-GPU runs (the noise floor), DDP and FSDP on GPUS
# GPUs at the same global batch, the FSDP variants, a save on GPUS and its resume on GPUS/2 and on one GPU; then one
# line per run: tokens/s per GPU against the first one-GPU run, peak memory, and the loss difference from it.
#
#   GPUS=8 MODEL=gated_deltanet SIZE=1.3b SEQ_LEN=16384 scripts/scaling_runs.sh
#   DRY_RUN=1 GPUS=4 MODEL=transformer SIZE=1.3b scripts/scaling_runs.sh     # print the commands only
#
# GPUS (8), MODEL (gated_deltanet), SIZE (1.3b), SEQ_LEN (16384), BATCH (1 row per GPU per micro step: the global
# batch is BATCH x GPUS rows), STEPS (50), OUT (runs/scaling/<model>-<size>-T<len>-<time>), EXTRA (more train.py
# overrides for every run), SKIP_ONE_GPU=1 (no one-GPU runs: a model that does not fit one GPU), PYTHON
# (.venv/bin/python), DDP_CONFIG / FSDP_CONFIG (conf/accelerate/ddp.yaml / fsdp.yaml). Run from the repository root.
set -euo pipefail

GPUS=${GPUS:-8}
MODEL=${MODEL:-gated_deltanet}
SIZE=${SIZE:-1.3b}
SEQ_LEN=${SEQ_LEN:-16384}
BATCH=${BATCH:-1}
STEPS=${STEPS:-50}
PYTHON=${PYTHON:-.venv/bin/python}
DDP_CONFIG=${DDP_CONFIG:-conf/accelerate/ddp.yaml}
FSDP_CONFIG=${FSDP_CONFIG:-conf/accelerate/fsdp.yaml}
OUT=${OUT:-runs/scaling/$MODEL-$SIZE-T$SEQ_LEN-$(date +%Y%m%d-%H%M%S)}
HALF=$((STEPS / 2))
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"

COMMON=(model="$MODEL" model/size="$SIZE" trainer.seq_len="$SEQ_LEN" model.max_position_embeddings="$SEQ_LEN"
        data=default data.shard=rows trainer.batch_size="$BATCH" trainer.max_steps="$STEPS" trainer.log_every=5
        trainer.val_every=0 trainer.val_batches=2 trainer.save_every=0 trainer.save_final=false
        trainer.progress_bar=false trainer.time_phases=true trainer.resume=none logger=none "${EXTRA_ARGS[@]}")

RUNS=()
train() {  # train NAME GPU-COUNT ACCELERATE-CONFIG|- OVERRIDE...: one run into $OUT/NAME
    local name=$1 n=$2 config=$3
    shift 3
    local cmd=("$PYTHON")
    if [[ $config != - ]]; then
        cmd+=(-m accelerate.commands.launch --config_file "$config" --num_processes "$n")
    fi
    cmd+=(train.py "${COMMON[@]}" "$@" name="$name" hydra.run.dir="$OUT/$name")
    RUNS+=("$name")
    if [[ -n ${DRY_RUN:-} ]]; then
        printf '%q ' "${cmd[@]}"
        echo
    else
        echo "== $name ($n GPU)"
        "${cmd[@]}"
    fi
}

if [[ -z ${SKIP_ONE_GPU:-} ]]; then  # the global batch by accumulation on one GPU, twice (the noise floor)
    train 1gpu-a 1 - trainer.grad_accum="$GPUS"
    train 1gpu-b 1 - trainer.grad_accum="$GPUS"
    train "ddp$GPUS" "$GPUS" "$DDP_CONFIG"
fi
train "fsdp$GPUS" "$GPUS" "$FSDP_CONFIG"
train "fsdp$GPUS-param_bf16" "$GPUS" "$FSDP_CONFIG" trainer.fsdp_param_dtype=bf16
train "fsdp$GPUS-prefetch1" "$GPUS" "$FSDP_CONFIG" trainer.fsdp_forward_prefetch=1
train "fsdp$GPUS-prefetch2" "$GPUS" "$FSDP_CONFIG" trainer.fsdp_forward_prefetch=2 trainer.fsdp_backward_prefetch=2
train "fsdp$GPUS-reduce_bf16" "$GPUS" "$FSDP_CONFIG" trainer.fsdp_reduce_dtype=bf16
# save at STEPS/2 on GPUS, resume there on GPUS/2 (and one GPU): the losses after STEPS/2 continue the saving run's
train "fsdp$GPUS-save" "$GPUS" "$FSDP_CONFIG" trainer.save_every="$HALF"
CKPT=$OUT/fsdp$GPUS-save/checkpoints/$(printf 'step_%08d' "$HALF")
train "fsdp$((GPUS / 2))-resumed" "$((GPUS / 2))" "$FSDP_CONFIG" trainer.grad_accum=2 trainer.resume="$CKPT"
if [[ -z ${SKIP_ONE_GPU:-} ]]; then
    train 1gpu-resumed 1 - trainer.grad_accum="$GPUS" trainer.resume="$CKPT"
fi

[[ -n ${DRY_RUN:-} ]] && exit 0
"$PYTHON" - "$OUT" "${RUNS[@]}" <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, ".")
from training.logging import read_metrics

out, names = Path(sys.argv[1]), sys.argv[2:]


def read(name):
    rows = read_metrics(out / name / "metrics.jsonl")
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    perf = [r for r in rows if "perf/tokens_per_s_per_device" in r][1:]  # the first window holds the warm-up
    tok = sum(r["perf/tokens_per_s_per_device"] for r in perf) / len(perf) if perf else float("nan")
    return losses, tok, max((r.get("perf/mem_peak_gib", 0.0) for r in perf), default=float("nan"))


runs = {name: read(name) for name in names}
base = runs.get("1gpu-a")
print(f"{'run':<24} {'tokens/s/GPU':>13} {'vs 1 GPU':>9} {'peak GiB':>9} {'max |dloss| vs 1gpu-a':>22}")
for name, (losses, tok, peak) in runs.items():
    ratio = f"{tok / base[1]:.1%}" if base else "-"
    common = sorted(set(losses) & set(base[0])) if base else []
    diff = f"{max(abs(losses[s] - base[0][s]) for s in common):.4f}" if common else "-"
    print(f"{name:<24} {tok:>13.0f} {ratio:>9} {peak:>9.2f} {diff:>22}")
save = runs.get(next((n for n in names if n.endswith("-save")), ""), None)
for name in (n for n in names if n.endswith("-resumed")):
    after = sorted(s for s in runs[name][0] if save and s in save[0])
    if after:
        print(f"{name}: max |dloss| vs the saving run over steps {after[0]}-{after[-1]}: "
              f"{max(abs(runs[name][0][s] - save[0][s]) for s in after):.4f}")
EOF
