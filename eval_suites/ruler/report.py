"""The RULER report: a task x length text table, JSON + PNG heatmap, and W&B tables and summary scalars."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def format_table(result: dict) -> str:
    """Scores (0..100) of every task at every length, with a per-task average column and an average row."""
    lengths = [str(length) for length in result["lengths"]]
    width = max(len("average"), *(len(task) for task in result["tasks"]))
    header = f"{'task':<{width}}" + "".join(f"{length:>9}" for length in lengths) + f"{'average':>9}"
    lines = [header, "-" * len(header)]
    for task in result["tasks"]:
        lines.append(f"{task:<{width}}" + "".join(f"{result['scores'][task][length]:9.1f}" for length in lengths)
                     + f"{result['average_by_task'][task]:9.1f}")
    lines.append("-" * len(header))
    lines.append(f"{'average':<{width}}" + "".join(f"{result['average_by_length'][length]:9.1f}"
                                                  for length in lengths) + f"{result['average']:9.1f}")
    return "\n".join(lines)


def write_report(result: dict, out_dir: str | Path, *, title: str | None = None) -> tuple[Path, Path]:
    """Write ``result`` (from ``evaluate``) to ``out_dir``/ruler.{json,png}; returns (json, png) paths. The PNG
    is a task x length heatmap of the scores with the averages as the last row and column."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "ruler.json", out_dir / "ruler.png"
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)

    lengths = [str(length) for length in result["lengths"]]
    rows = [*result["tasks"], "average"]
    grid = [[result["scores"][task][length] for length in lengths] + [result["average_by_task"][task]]
            for task in result["tasks"]]
    grid.append([result["average_by_length"][length] for length in lengths] + [result["average"]])
    fig = Figure(figsize=(1.3 * len(lengths) + 4, 0.45 * len(rows) + 1.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for r, row in enumerate(grid):
        for c, value in enumerate(row):
            ax.text(c, r, f"{value:.1f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths) + 1), [*lengths, "average"])
    ax.set_yticks(range(len(rows)), rows)
    ax.axhline(len(rows) - 1.5, color="black", lw=1)
    ax.axvline(len(lengths) - 0.5, color="black", lw=1)
    ax.set_xlabel("length (tokens)")
    fig.colorbar(image, ax=ax, label="string_match_all (%)")
    ax.set_title(title or f"RULER NIAH ({result['num_samples']} samples per task and length)")
    fig.savefig(png_path, dpi=120)
    return json_path, png_path


def log_to_wandb(result: dict, run: Any, *, prefix: str = "ruler") -> None:
    """Log a (task, length, score) table and a per-sample table to a W&B run, and put every score and average in
    ``run.summary`` as ``prefix/<task>/<length>``, ``prefix/average/<length>``, ``prefix/<task>/average`` and
    ``prefix/average``. Does nothing when ``run`` is None; wandb is imported only here."""
    if run is None:
        return
    import wandb

    scores = wandb.Table(columns=["task", "length", "score"], data=[
        [task, int(length), score] for task, by_length in result["scores"].items() for length, score in by_length.items()])
    samples = wandb.Table(columns=["task", "length", "index", "prompt_tokens", "answers", "prediction", "score"],
                          data=[[s["task"], s["length"], s["index"], s["prompt_tokens"], ", ".join(s["answers"]),
                                 s["prediction"], s["score"]] for s in result["samples"]])
    run.log({f"{prefix}/scores": scores, f"{prefix}/samples": samples})
    summary = {f"{prefix}/average": result["average"]}
    for task, by_length in result["scores"].items():
        summary.update({f"{prefix}/{task}/{length}": score for length, score in by_length.items()})
        summary[f"{prefix}/{task}/average"] = result["average_by_task"][task]
    summary.update({f"{prefix}/average/{length}": score for length, score in result["average_by_length"].items()})
    run.summary.update(summary)
