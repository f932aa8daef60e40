"""The MQAR table of an experiment=mqar_sweep sweep: per model and width, the best learning rate's mean +- std
(over seeds) of each run's best overall accuracy (val/mqar_acc: the mean of the test examples' accuracies, as
Zoology counts it), as Markdown and CSV.

    python benchmarks/mqar_table.py runs/sweeps/mqar_sweep [more run dirs ...] [--out runs/sweeps/mqar_sweep/mqar_table]

Every directory under the given ones that holds a config.yaml is a run: its model (model.name), width
(model.hidden_size), learning rate (optim.lr) and seed come from config.yaml; its accuracy is summary.json's
best_mqar_acc, or, for a run without a summary (still running, killed), the largest val/mqar_acc in
metrics.jsonl; runs with neither are skipped and counted. A run of a recipe variant (mqar_sweep.py --variant) has
its variant's name on the first line of variant.txt and gets rows of its own ("mamba2 (init)"). For each (model,
variant, width, lr) the accuracies are averaged over seeds (std: sample standard deviation, 0 for one seed). The
rates are ranked on the seeds that all of them have run (a rate run with seeds 0-2 against one run with seed 0
only: on seed 0), so another rate's extra seeds neither help nor hurt it; with no seed in common, on each rate's own
mean. The best rate's mean and std over all its seeds are reported, with the number of its runs that are unfinished
(no summary, or stopped by a signal: their accuracy is the best so far, a lower bound).

Reference (the log-linear attention paper, T = 256, 4-64 pairs; accuracy % at widths 16 / 32 / 64), to
reproduce in trend:

    Mamba-2                      46.9 / 75.1 / 89.6
    log-linear Mamba-2           55.9 / 76.5 / 92.9
    Gated DeltaNet               38.4 / 79.0 / >= 99
    log-linear Gated DeltaNet    40.0 / 84.4 / >= 99
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

# The paper's row order; other models follow alphabetically.
MODEL_ORDER = ("transformer", "mamba2", "loglinear_mamba2", "gated_deltanet", "loglinear_gated_deltanet",
               "hla_transformer", "hla_mamba2", "hla_gated_deltanet")
REFERENCE = {"mamba2": (46.9, 75.1, 89.6), "loglinear_mamba2": (55.9, 76.5, 92.9),
             "gated_deltanet": (38.4, 79.0, 99.0), "loglinear_gated_deltanet": (40.0, 84.4, 99.0)}
CSV_FIELDS = ("model", "variant", "width", "best_lr", "mean_acc", "std_acc", "num_seeds", "seeds", "lrs",
              "unfinished")


def read_summary(run_dir: Path) -> dict | None:
    """run_dir/summary.json, or None where there is none or it cannot be read (a run killed while writing it): a
    warning names the file, and the run's metrics.jsonl is what is left of its record."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
        if isinstance(summary, dict):
            return summary
        problem = f"a JSON {type(summary).__name__}, not an object"
    except (OSError, ValueError) as err:
        problem = str(err)[:80]
    print(f"warning: {path} is not a run summary ({problem}); the run is read from its metrics.jsonl and counts as "
          f"unfinished", file=sys.stderr)
    return None


def finished(summary: dict | None) -> bool:
    """Whether a run ended (max_steps or its early stop), not stopped by a signal to be resumed."""
    return summary is not None and not summary.get("stopped_by_signal")


def run_accuracy(run_dir: Path, summary: dict | None) -> float | None:
    """A run's best overall MQAR accuracy: its summary's best_mqar_acc, else the max val/mqar_acc logged."""
    best = (summary or {}).get("best_mqar_acc")
    if best is not None:
        return float(best)
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        accs = [json.loads(line).get("val/mqar_acc") for line in metrics.read_text().splitlines() if line.strip()]
        accs = [a for a in accs if a is not None]
        if accs:
            return float(max(accs))
    return None


def collect_runs(roots: list[Path]) -> tuple[list[dict], int]:
    """(runs, skipped): one dict per run dir (model, variant, width, lr, seed, acc, finished, dir); skipped counts
    runs without any accuracy."""
    runs, skipped = [], 0
    for root in roots:
        for config_path in sorted(Path(root).rglob("config.yaml")):
            if config_path.parent.name == ".hydra" or "checkpoints" in config_path.parts:
                continue
            run_dir = config_path.parent
            cfg = yaml.safe_load(config_path.read_text())
            summary = read_summary(run_dir)  # once: an unreadable one warns once
            acc = run_accuracy(run_dir, summary)
            if acc is None:
                skipped += 1
                continue
            variant_file = run_dir / "variant.txt"
            variant = variant_file.read_text().split("\n")[0].strip() if variant_file.is_file() else ""
            runs.append({"model": cfg["model"]["name"], "variant": variant, "width": int(cfg["model"]["hidden_size"]),
                         "lr": float(cfg["optim"]["lr"]), "seed": int(cfg["seed"]), "acc": acc,
                         "finished": finished(summary), "dir": str(run_dir)})
    return runs, skipped


def _mean_on_shared_seeds(by_lr: dict[float, dict[int, float]], lr: float) -> float:
    """lr's mean accuracy over the seeds every rate of by_lr has run; over its own seeds when they share none."""
    shared = set.intersection(*(set(seeds) for seeds in by_lr.values()))
    return statistics.fmean([by_lr[lr][seed] for seed in shared] if shared else by_lr[lr].values())


def build_table(runs: list[dict]) -> list[dict]:
    """Per (model, variant, width): the best lr (ranked on the seeds every lr has run), with its mean and std."""
    groups: dict[tuple, dict[float, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    unfinished: dict[tuple, set[int]] = defaultdict(set)  # (model, variant, width, lr) -> seeds still running
    for r in runs:
        groups[(r["model"], r.get("variant", ""), r["width"])][r["lr"]][r["seed"]] = r["acc"]
        if not r.get("finished", True):
            unfinished[(r["model"], r.get("variant", ""), r["width"], r["lr"])].add(r["seed"])
    rows = []
    for (model, variant, width), by_lr in groups.items():
        stats = {lr: (statistics.fmean(s.values()), statistics.stdev(s.values()) if len(s) > 1 else 0.0, s)
                 for lr, s in by_lr.items()}
        best_lr = max(stats, key=lambda lr: (_mean_on_shared_seeds(by_lr, lr), -lr))
        mean, std, seeds = stats[best_lr]
        rows.append({"model": model, "variant": variant, "width": width, "best_lr": best_lr, "mean_acc": mean, "std_acc": std,
                     "num_seeds": len(seeds), "seeds": " ".join(str(s) for s in sorted(seeds)),
                     "lrs": " ".join(f"{lr:g}" for lr in sorted(by_lr)),
                     "unfinished": len(unfinished[(model, variant, width, best_lr)])})
    rank = {m: i for i, m in enumerate(MODEL_ORDER)}
    return sorted(rows, key=lambda r: (rank.get(r["model"], len(rank)), r["model"], r["variant"], r["width"]))


def to_markdown(rows: list[dict]) -> str:
    """Models x widths: accuracy % as mean ± std (best lr), plus the paper's numbers where the reference above gives them."""
    widths = sorted({r["width"] for r in rows})
    cell = {(r["model"], r["variant"], r["width"]): r for r in rows}
    models = list(dict.fromkeys((r["model"], r["variant"]) for r in rows))
    lines = ["| model | " + " | ".join(f"d = {w}" for w in widths) + " | paper (16 / 32 / 64) |",
             "|---|" + "---|" * (len(widths) + 1)]
    for m, variant in models:
        cells = []
        for w in widths:
            r = cell.get((m, variant, w))
            unfinished = f", {r['unfinished']} unfinished" if r is not None and r.get("unfinished") else ""
            cells.append("" if r is None else f"{100 * r['mean_acc']:.1f} ± {100 * r['std_acc']:.1f} "
                                              f"(lr {r['best_lr']:g}, {r['num_seeds']} seeds{unfinished})")
        ref = REFERENCE.get(m)
        ref_text = " / ".join(f"{v:.1f}" if v < 99 else "≥99" for v in ref) if ref else ""
        label = f"{m} ({variant})" if variant else m
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ref_text} |")
    return "\n".join(lines) + "\n"


def write_table(rows: list[dict], out_prefix: Path) -> tuple[Path, Path]:
    """Write <out_prefix>.md and <out_prefix>.csv; return their paths."""
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_prefix.with_suffix(".md"), out_prefix.with_suffix(".csv")
    md.write_text(to_markdown(rows))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{r[k]:.6f}" if isinstance(r[k], float) and not math.isnan(r[k]) else r[k])
                             for k in CSV_FIELDS})
    return md, csv_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="sweep or run directories (searched recursively)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output prefix (default: <first run dir>/mqar_table -> .md and .csv)")
    args = parser.parse_args(argv)
    runs, skipped = collect_runs(args.run_dirs)
    if not runs:
        print(f"no MQAR runs with an accuracy under {[str(d) for d in args.run_dirs]} ({skipped} without one)",
              file=sys.stderr)
        return 1
    rows = build_table(runs)
    md, csv_path = write_table(rows, args.out or args.run_dirs[0] / "mqar_table")
    print(to_markdown(rows))
    print(f"{len(runs)} runs ({skipped} skipped without an accuracy) -> {md}, {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
