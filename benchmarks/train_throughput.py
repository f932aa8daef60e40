"""Training throughput of real train.py steps: tokens/s, MFU, peak memory, data-wait share.

    python benchmarks/train_throughput.py --sizes tiny 340m --seq-len 2048 --batch-size 8 --steps 40
    python benchmarks/train_throughput.py --model transformer --sizes 340m --append   # also writes RESULTS.md
    python benchmarks/train_throughput.py --model mamba2 --sizes 340m --fused-norms   # Triton norms (model.fused_norms)

Each configuration runs train.run() in-process on the embedded corpus with the real loader and optimizer (bf16
autocast on CUDA), W&B off and no checkpoint, and reports the mean of the log windows after the first (the first
holds compilation and allocator warm-up).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(model: str, size: str, seq_len: int, batch_size: int, steps: int, extra: list[str]) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from hydra import compose, initialize_config_dir

    import train
    from training.logging import read_metrics

    log_every = max(steps // 4, 1)
    overrides = [f"model={model}", f"model/size={size}", f"trainer.seq_len={seq_len}",
                 f"trainer.batch_size={batch_size}", f"trainer.max_steps={steps}", f"trainer.log_every={log_every}",
                 "trainer.val_every=0", "trainer.val_batches=1", "trainer.save_every=0", "trainer.save_final=false",
                 "trainer.progress_bar=false", "logger=none", *extra]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with tempfile.TemporaryDirectory() as run_dir:
        train.run(cfg, run_dir=run_dir)
        rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "perf/tokens_per_s" in r]
    steady = rows[1:] or rows
    mean = lambda key: sum(r.get(key) or 0.0 for r in steady) / len(steady)  # noqa: E731
    return {"model": model, "size": size, "seq_len": seq_len, "batch_size": batch_size, "steps": steps,
            "tokens_per_s": mean("perf/tokens_per_s"), "mfu": mean("perf/mfu") if "perf/mfu" in steady[0] else None,
            "mem_peak_gib": max(r["perf/mem_peak_gib"] for r in rows), "data_wait_frac": mean("perf/data_wait_frac"),
            "final_loss": rows[-1]["train/loss"]}


def table(results: list[dict]) -> str:
    lines = ["| model | size | seq_len | batch | tokens/s | MFU | peak mem (GiB) | data wait | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['model']} | {r['size']} | {r['seq_len']} | {r['batch_size']} | {r['tokens_per_s']:,.0f} "
                     f"| {mfu} | {r['mem_peak_gib']:.2f} | {100 * r['data_wait_frac']:.1f}% | {r['final_loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--sizes", nargs="+", default=["tiny"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    ap.add_argument("--fused-norms", action="store_true",
                    help="run the norms as Triton kernels (the Hydra override ++model.fused_norms=true)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()

    import torch

    overrides = [*args.overrides, "++model.fused_norms=true"] if args.fused_norms else args.overrides
    results = [measure(args.model, size, args.seq_len, args.batch_size, args.steps, overrides)
               for size in args.sizes]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "CPU"
    text = table(results)
    print(text)
    print(json.dumps(results))
    if args.append:
        stamp = datetime.date.today().isoformat()
        cmd = "python " + " ".join(sys.argv)
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(f"\n### Training throughput, {stamp}, {device}, torch {torch.__version__}\n\n`{cmd}`\n\n{text}\n")


if __name__ == "__main__":
    main()
