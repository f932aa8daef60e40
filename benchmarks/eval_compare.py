"""Several runs' final-eval reports side by side: one figure of their perplexity-by-position curves (a panel per
evaluated length) and a Markdown file with the perplexity and RULER tables.

    python benchmarks/eval_compare.py runs/longctx-*-125m-T4096 --out runs/longctx_compare
    python benchmarks/eval_compare.py mamba2=runs/a loglinear_mamba2=runs/b --out DIR

A run is a training run's directory (its reports are eval/<name>/ppl_by_position.json and eval/<name>/ruler.json,
as trainer.final_evals writes them) or any directory holding such report folders; NAME=DIR labels it, else its
model.name from config.yaml, else the directory's name. Writes DIR/ppl_by_position.png and DIR/eval_compare.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def load_run(spec: str) -> tuple[str, dict[int, dict], list[dict]]:
    """(label, {seq_len: ppl_by_position result}, [ruler results]) of one run spec, NAME=DIR or DIR."""
    label, sep, path = spec.partition("=")
    run_dir = Path(path if sep else spec)
    if not run_dir.is_dir():
        raise SystemExit(f"{run_dir} is not a directory: give a run directory (or NAME=DIR)")
    if not sep:
        label = _model_name(run_dir) or run_dir.name
    reports = run_dir / "eval" if (run_dir / "eval").is_dir() else run_dir
    ppl = {}
    for file in sorted(reports.glob("*/ppl_by_position.json")):
        result = json.loads(file.read_text())
        if result["seq_len"] in ppl:
            raise SystemExit(f"{run_dir} has two perplexity reports at seq_len {result['seq_len']}: keep one")
        ppl[result["seq_len"]] = result
    ruler = [json.loads(file.read_text()) for file in sorted(reports.glob("*/ruler.json"))]
    if not ppl and not ruler:
        raise SystemExit(f"{reports} holds no */ppl_by_position.json or */ruler.json: was the run evaluated "
                         "(trainer.final_evals, or eval.py with eval.out_dir there)?")
    return label, ppl, ruler


def _model_name(run_dir: Path) -> str | None:
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    return ((yaml.safe_load(config.read_text()) or {}).get("model") or {}).get("name")


def ppl_tables(runs: list[tuple[str, dict, list]]) -> list[str]:
    """A Markdown table per evaluated length: overall ppl, before / after the training length, and the ppl of
    each power-of-two position range."""
    lines = []
    for seq_len in sorted({t for _, ppl, _ in runs for t in ppl}):
        rows = [(label, ppl[seq_len]) for label, ppl, _ in runs if seq_len in ppl]
        buckets = [(b["start"], b["end"]) for b in rows[0][1]["log2_buckets"]]
        train_len = rows[0][1].get("train_len")
        head = ["run", "ppl", *(["ppl <= train len", "ppl > train len"] if train_len and train_len < seq_len else []),
                *(f"[{s}, {e})" for s, e in buckets)]
        title = (f"Perplexity by position at {seq_len} tokens (train length {train_len}; "
                 f"{rows[0][1]['num_documents']} documents):")
        lines += [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for label, result in rows:
            by_range = {(b["start"], b["end"]): b["ppl"] for b in result["log2_buckets"]}
            cells = [label, _num(result["ppl"])]
            if train_len and train_len < seq_len:
                cells += [_num(result.get("ppl_before_train_len")), _num(result.get("ppl_after_train_len"))]
            cells += [_num(by_range.get(r)) for r in buckets]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def ruler_table(runs: list[tuple[str, dict, list]]) -> list[str]:
    """One row per run, a column per (task, length), and the average, in RULER's 0-100 scores."""
    cells = sorted({(task, length) for _, _, reports in runs for r in reports
                    for task in r["tasks"] for length in r["lengths"]})
    if not cells:
        return []
    head = ["run", *(f"{task} @ {length}" for task, length in cells), "average"]
    lines = ["RULER (string_match_all, %):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, _, reports in runs:
        for report in reports:
            scores = [report["scores"].get(task, {}).get(str(length)) for task, length in cells]
            lines.append("| " + " | ".join([label, *(_num(s, 1) for s in scores), _num(report["average"], 1)]) + " |")
    return lines + [""]


def plot(runs: list[tuple[str, dict, list]], path: Path) -> None:
    """Smoothed per-position NLL of every run, one panel per evaluated length, log position axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lengths = sorted({t for _, ppl, _ in runs for t in ppl})
    fig = Figure(figsize=(9, 3.6 * len(lengths) + 0.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(lengths), 1, squeeze=False)[:, 0]
    for ax, seq_len in zip(axes, lengths):
        train_len = None
        for label, ppl, _ in runs:
            if seq_len in ppl:
                result = ppl[seq_len]
                train_len = result.get("train_len")
                ax.plot(range(1, seq_len + 1), result["smoothed_nll"], lw=1.3, label=f"{label} (ppl {result['ppl']:.3g})")
        if train_len:
            ax.axvline(train_len, color="black", ls="--", lw=0.8, label=f"train length {train_len}")
        ax.set_xscale("log")
        ax.set_ylabel("NLL (nats), moving average")
        ax.set_title(f"{seq_len} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("position p (tokens of context)")
    fig.savefig(path, dpi=120)


def _num(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories, or NAME=DIR")
    parser.add_argument("--out", required=True, type=Path, help="directory for ppl_by_position.png and eval_compare.md")
    args = parser.parse_args(argv)
    runs = [load_run(spec) for spec in args.runs]
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join([*ppl_tables(runs), *ruler_table(runs)])
    written = [args.out / "eval_compare.md"]
    written[0].write_text(text)
    if any(ppl for _, ppl, _ in runs):
        written.append(args.out / "ppl_by_position.png")
        plot(runs, written[-1])
    print(text)
    print("-> " + ", ".join(map(str, written)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
