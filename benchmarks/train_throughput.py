"""Training throughput of real train.py steps: tokens/s, MFU, peak memory and the step-time breakdown.

    python benchmarks/train_throughput.py        # every family, 340m, T = 2048 8192 16384
    python benchmarks/train_throughput.py --models transformer mamba2 --seq-lens 16384 32768 --sizes 760m
    python benchmarks/train_throughput.py --model transformer --sizes tiny 340m --seq-len 2048 --batch-size 8 --steps 40
    python benchmarks/train_throughput.py --models transformer --fused-projections   # model.fused_projections
    python benchmarks/train_throughput.py --models mamba2 --compile       # torch.compile'd blocks (trainer.compile)

`make bench` (no ARGS) runs this script with its defaults, the measurement of docs/performance.md at 340m: every family
(FAMILIES) at sequence lengths 2048, 8192 and 16384 with a fixed 32,768 tokens per optimizer step (batch size
32768 // seq_len rows); --sizes defaults to 340m on CUDA and tiny on CPU. --batch-size N instead fixes the rows per
step at every length. --model and --seq-len are aliases of --models and --seq-lens.

Each configuration (model, size, seq_len) runs training.trainer.run() in-process on the embedded corpus with the real loader
and optimizer (bf16 autocast on CUDA), model.max_position_embeddings = seq_len (the log-linear families' levels),
trainer.time_phases on, W&B off and no checkpoint, and reports the mean of the log windows after the first (the
first holds compilation, Triton's and with --compile torch.compile's, and allocator warm-up): tokens/s, MFU (the
model's num_flops_per_token against the GPU's bf16 peak), peak allocated memory of that configuration,
milliseconds per optimizer step, and its breakdown as shares of the step: data wait (host time in the loader),
forward (with the loss), backward, optimizer (clipping, step, scheduler, zero_grad). On CUDA the three phases are
device time between CUDA events, while the data wait is host time that can overlap the device's tail of the
previous step; what the shares leave is host-to-device copies, launch gaps between phases and the loop's own
overhead. A configuration that runs out of GPU memory (torch.cuda.OutOfMemoryError) is a row saying OOM and the
remaining configurations still run. The last column says whether the blocks ran compiled (--compile:
trainer.compile=true, training.compile).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO))

from benchmarks.decode import FAMILIES, parse_with_overrides, unknown_sizes

SEQ_LENS = (2048, 8192, 16384)
TOKENS_PER_STEP = 32768
PHASES = ("data_wait", "forward", "backward", "optimizer")


def measure(model: str, size: str, seq_len: int, batch_size: int, steps: int, extra: list[str],
            compiled: bool = False) -> dict:
    """One configuration's row: the means over the steady log windows, or status "OOM". compiled adds
    trainer.compile=true; the row's "compiled" is the run's trainer.compile."""
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from hydra import compose, initialize_config_dir

    from training import trainer
    from training.logging import read_metrics

    row = {"model": model, "size": size, "seq_len": seq_len, "batch_size": batch_size, "steps": steps}
    log_every = max(steps // 4, 1)
    overrides = [f"model={model}", f"model/size={size}", f"model.max_position_embeddings={seq_len}",
                 f"trainer.seq_len={seq_len}", f"trainer.batch_size={batch_size}", f"trainer.max_steps={steps}",
                 f"trainer.log_every={log_every}", "trainer.val_every=0", "trainer.val_batches=1",
                 "trainer.save_every=0", "trainer.save_final=false", "trainer.progress_bar=false",
                 "trainer.time_phases=true", "logger=none", *extra, *(["trainer.compile=true"] if compiled else [])]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    row["compiled"] = bool(cfg.trainer.get("compile"))
    row["grad_accum"] = int(cfg.trainer.grad_accum)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    oom = False
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            trainer.run(cfg, run_dir=run_dir)
        except torch.cuda.OutOfMemoryError:
            oom = True  # the handler ends here, dropping the traceback (and the failed run's tensors) before cleanup
        rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "perf/tokens_per_s" in r]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if oom:
        return {**row, "status": "OOM"}
    steady = rows[1:] or rows
    mean = lambda key: sum(r.get(key) or 0.0 for r in steady) / len(steady)
    step_s = mean("perf/step_time_s")
    row.update(status="ok", tokens_per_s=mean("perf/tokens_per_s"),
               mfu=mean("perf/mfu") if "perf/mfu" in steady[0] else None,
               mem_peak_gib=max(r["perf/mem_peak_gib"] for r in rows), step_ms=1e3 * step_s,
               final_loss=rows[-1]["train/loss"])
    # data_wait_s is a window's sum, the phases are per-step means: both as shares of the window's step time
    row["data_wait_frac"] = mean("perf/data_wait_frac")
    for phase in PHASES[1:]:
        row[f"{phase}_frac"] = mean(f"perf/{phase}_s") / step_s if step_s > 0 else 0.0
    return row


def table(results: list[dict]) -> str:
    lines = [("| model | size | seq_len | batch | tokens/s | MFU | peak mem (GiB) | ms/step | data wait | forward "
              "| backward | optimizer | loss | compiled |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        # rows per micro step, times the micro steps of an optimizer step under gradient accumulation
        accum = r.get("grad_accum", 1)
        batch = f"{r['batch_size']}x{accum}" if accum > 1 else f"{r['batch_size']}"
        head = f"| {r['model']} | {r['size']} | {r['seq_len']} | {batch} |"
        compiled = "yes" if r.get("compiled") else "no"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']} |" + " - |" * 8 + f" {compiled} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        shares = " | ".join(f"{100 * r[f'{p}_frac']:.1f}%" for p in PHASES)
        lines.append(f"{head} {r['tokens_per_s']:,.0f} | {mfu} | {r['mem_peak_gib']:.2f} | {r['step_ms']:.1f} "
                     f"| {shares} | {r['final_loss']:.3f} | {compiled} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", "--model", nargs="+", default=list(FAMILIES), metavar="MODEL",
                    help=f"model configs (conf/model/<name>.yaml), default every family: {' '.join(FAMILIES)}")
    ap.add_argument("--sizes", nargs="+", default=None, help="presets (conf/model/size), default 340m (CPU: tiny)")
    ap.add_argument("--seq-lens", "--seq-len", nargs="+", type=int, default=list(SEQ_LENS), metavar="T")
    rows = ap.add_mutually_exclusive_group()
    rows.add_argument("--tokens-per-step", type=int, default=None,
                      help=f"tokens per optimizer step: batch size = this // seq_len (default {TOKENS_PER_STEP})")
    rows.add_argument("--batch-size", type=int, default=None, help="rows per step at every seq_len instead")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fused-projections", action="store_true",
                    help="the projections of one layer input as one matmul (++model.fused_projections=true)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every block's training forward (the Hydra override trainer.compile=true)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (key=value), anywhere on the "
                                                 "command line")
    args = parse_with_overrides(ap, list(sys.argv[1:] if argv is None else argv))
    unknown = [m for m in args.models if not (REPO / "conf" / "model" / f"{m}.yaml").is_file()]
    if unknown:
        known = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
        ap.error(f"unknown model(s) {unknown}: --models takes names of conf/model/<name>.yaml: {' '.join(known)}")
    if (message := unknown_sizes(args.sizes or [])) is not None:
        ap.error(message)
    if any(t < 1 for t in args.seq_lens):
        ap.error(f"--seq-lens must be positive token counts, got {args.seq_lens}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size is None:
        args.tokens_per_step = args.tokens_per_step or TOKENS_PER_STEP
        too_short = [t for t in args.seq_lens if args.tokens_per_step // t < 1]
        if too_short:
            ap.error(f"--tokens-per-step {args.tokens_per_step} is less than one row at seq_len {too_short}")
    elif args.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)

    import torch

    sizes = args.sizes or (["340m"] if torch.cuda.is_available() else ["tiny"])
    overrides = [*args.overrides, *(["++model.fused_projections=true"] if args.fused_projections else [])]
    results = []
    for model in args.models:
        for size in sizes:
            for seq_len in args.seq_lens:
                batch_size = args.batch_size or args.tokens_per_step // seq_len
                results.append(measure(model, size, seq_len, batch_size, args.steps, overrides, args.compile))
                print(json.dumps(results[-1]), flush=True)
    print(table(results))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
