"""Run an MQAR grid with many points at once on one machine, then print its table (benchmarks/mqar_table.py).

    python benchmarks/mqar_sweep.py --out runs/mqar_grid --jobs 16 \
        --models mamba2,gated_deltanet --widths 32,64 --lrs 4.6e-4,1e-3,2.2e-3 --seeds 0,1,2 \
        [--gpus 0,1] [--variant NAME [OVERRIDE ...] (repeatable)] [-- trainer.max_steps=6000 ...]

MQAR models are tiny (2 layers, width 16-64): one run leaves a GPU mostly idle, waiting on Python and kernel
launches. Running --jobs points as separate processes on the same GPU (round-robin over --gpus when given) fills it.
Each point gets an equal share of the CPU cores (OMP_NUM_THREADS = cores // jobs, unless set): with torch's default
of one thread per core in every point, the points' thread pools starve each other. Every point is one `train.py
experiment=mqar_sweep` run with its own directory under --out (<model>-d<width>-lr<lr>-s<seed>/: config.yaml,
metrics.jsonl, summary.json, train.log); overrides after `--` go to every point. A point whose run finished (its
summary.json says it was not stopped by a signal) is skipped; one stopped by a signal is started again and resumes
from its checkpoint. SIGTERM or SIGINT to the sweep stops it: no new point starts, each running point gets SIGTERM
(it saves a checkpoint at its next step and exits), and the same command later continues the grid where it stopped.
At the end the sweep's throughput (optimizer steps of all points per second of wall time) and the table (best lr per
model and width, mean +- std over seeds, beside the paper's numbers) are printed and written to <out>/mqar_table.md
and .csv (the throughput to <out>/sweep_result.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import mqar_table


def split_list(text: str, kind=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"empty list: {text!r}")
    return [kind(t) for t in items]


# A variant is a named set of overrides applied to every point of the grid (a recipe ablation); the default grid
# has one unnamed variant with none, so its point names (and directories to resume) are the plain ones.
NO_VARIANT = ("", ())
VARIANT_FILE = "variant.txt"  # in a point's directory: its variant's name (read by mqar_table.py), then its overrides


def point_name(model: str, width: int, lr: float, seed: int, variant: str = "") -> str:
    return f"{model}-d{width}-lr{lr:g}-s{seed}" + (f"-{variant}" if variant else "")


def point_command(model: str, width: int, lr: float, seed: int, run_dir: Path, extra: list[str],
                  variant_overrides=()) -> list[str]:
    """train.py's command line for one point: the grid's overrides (extra), then its variant's (which win)."""
    return [sys.executable, str(REPO_ROOT / "train.py"), "experiment=mqar_sweep", f"+model/mqar={model}",
            f"model.hidden_size={width}", f"optim.lr={lr:g}", f"seed={seed}", f"hydra.run.dir={run_dir}",
            f"name={run_dir.name}", "trainer.progress_bar=false", *extra, *variant_overrides]


def parse_variants(specs: list[list[str]] | None) -> list[tuple[str, tuple[str, ...]]]:
    """--variant NAME [OVERRIDE ...] arguments as [(name, overrides)]; [NO_VARIANT] when none is given. A variant
    without overrides is the grid's own recipe under a name (the baseline row of an ablation)."""
    if not specs:
        return [NO_VARIANT]
    variants = []
    for spec in specs:
        name, overrides = spec[0], tuple(spec[1:])
        if "=" in name:
            raise ValueError(f"--variant {name!r}: the first word is the variant's name, then its overrides")
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ValueError(f"--variant name {name!r}: use letters, digits and _ (it ends the points' directory names)")
        if name in {v[0] for v in variants}:
            raise ValueError(f"--variant {name} is given twice")
        variants.append((name, overrides))
    return variants


class StopFlag:
    """SIGTERM / SIGINT set the flag while the grid runs (the previous handlers are restored after)."""

    def __init__(self):
        self.set, self._old = False, {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.set = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def point_env(jobs: int, environ: dict | None = None, cores: int | None = None) -> dict:
    """The environment of one point: the caller's, with OMP_NUM_THREADS set to an equal share of the cores unless
    the caller set it. torch otherwise starts one thread per core in every point, and `jobs` points of busy-waiting
    thread pools starve each other (on 16 cores, 8 GPU points ran 53 steps/s together with 16 threads each and 219
    with one: docs/performance.md#mqar)."""
    env = dict(os.environ if environ is None else environ)
    if "OMP_NUM_THREADS" not in env:
        cores = cores or len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(max(1, cores // jobs))
    return env


def run_grid(points: list[tuple], out: Path, jobs: int, gpus: list[str] | None, extra: list[str]) -> dict:
    """Run every (model, width, lr, seed) point not yet finished, at most `jobs` at a time; return counts, wall
    time, the optimizer steps this call ran and whether a signal interrupted it."""
    todo, start_step = [], {}
    for model, width, lr, seed, *rest in points:
        variant, overrides = rest[0] if rest else NO_VARIANT
        run_dir = out / point_name(model, width, lr, seed, variant)
        summary = mqar_table.read_summary(run_dir)
        if mqar_table.finished(summary):
            continue
        start_step[run_dir] = int(summary.get("step", 0)) if summary else 0  # a resumed point counts its new steps
        if variant:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / VARIANT_FILE).write_text("\n".join((variant, *overrides)) + "\n")
        todo.append((run_dir, point_command(model, width, lr, seed, run_dir, extra, overrides)))
    running: list[tuple[subprocess.Popen, Path, object]] = []
    failed: list[Path] = []
    start = time.perf_counter()
    ran = [run_dir for run_dir, _ in todo]
    with StopFlag() as stop:
        launched = _loop(todo, running, failed, jobs, gpus, stop)
    wall = time.perf_counter() - start
    steps = 0
    for run_dir in ran:
        summary = mqar_table.read_summary(run_dir)
        if summary is not None:
            steps += max(int(summary.get("step", 0)) - start_step[run_dir], 0)
    return {"launched": launched, "failed": [str(f) for f in failed], "wall_s": wall, "steps": steps,
            "interrupted": stop.set}


def _loop(todo, running, failed, jobs, gpus, stop: StopFlag) -> int:
    """Launch points while slots are free until todo is empty and every point has exited; on a stop signal,
    launch nothing more and pass SIGTERM to the running points, then wait for them. Returns the points launched."""
    launched, forwarded = 0, False
    while running or (todo and not stop.set):
        if stop.set and not forwarded:
            for proc, _, _ in running:
                proc.send_signal(signal.SIGTERM)
            forwarded = True
        while todo and len(running) < jobs and not stop.set:
            run_dir, cmd = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            env = point_env(jobs)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[launched % len(gpus)]
            log = open(run_dir / "sweep.log", "w")  # noqa: SIM115 (open for the point's life, closed when it ends)
            running.append((subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                            run_dir, log))
            launched += 1
        time.sleep(0.5)
        for item in list(running):
            proc, run_dir, log = item
            if proc.poll() is None:
                continue
            log.close()
            running.remove(item)
            if proc.returncode != 0:
                failed.append(run_dir)
                print(f"point failed (exit {proc.returncode}): {run_dir}/sweep.log", file=sys.stderr)
    return launched


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the grid's runs")
    parser.add_argument("--models", type=split_list, required=True,
                        help=f"comma-separated conf/model/mqar names, e.g. {','.join(mqar_table.MODEL_ORDER[:3])}")
    parser.add_argument("--widths", type=lambda t: split_list(t, int), default=[16, 32, 64])
    parser.add_argument("--lrs", type=lambda t: split_list(t, float), default=[1e-4, 4.6e-4, 2.2e-3, 1e-2])
    parser.add_argument("--seeds", type=lambda t: split_list(t, int), default=[0])
    parser.add_argument("--jobs", type=int, default=1, help="points run at once")
    parser.add_argument("--gpus", type=split_list, default=None,
                        help="CUDA device indices the points are spread over, round-robin (default: inherit)")
    parser.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "OVERRIDE"),
                        help="a recipe variant: its name, then train.py overrides applied to every point after those "
                             "after -- (none: the grid's own recipe under that name); repeat for more (the grid runs "
                             "each); default: none")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    known = {p.stem for p in (REPO_ROOT / "conf" / "model" / "mqar").glob("*.yaml")}
    unknown = [m for m in args.models if m not in known]
    if unknown:
        parser.error(f"unknown MQAR model(s) {unknown}; conf/model/mqar has {sorted(known)}")
    try:
        variants = parse_variants(args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    points = list(itertools.product(args.models, args.widths, args.lrs, args.seeds, variants))
    result = run_grid(points, args.out.resolve(), args.jobs, args.gpus, extra)
    result["steps_per_s"] = result["steps"] / max(result["wall_s"], 1e-9)
    (args.out / "sweep_result.json").write_text(json.dumps({**result, "jobs": args.jobs, "points": len(points)}))
    print(f"{len(points)} points ({result['launched']} run now, {len(result['failed'])} failed) in "
          f"{result['wall_s']:.0f} s: {result['steps_per_s']:.1f} optimizer steps/s "
          f"over all points ({result['steps']} steps)")
    runs, skipped = mqar_table.collect_runs([args.out])
    if runs:
        rows = mqar_table.build_table(runs)
        md, csv_path = mqar_table.write_table(rows, args.out / "mqar_table")
        print(mqar_table.to_markdown(rows))
        print(f"{len(runs)} runs ({skipped} without an accuracy) -> {md}, {csv_path}")
    if result["interrupted"]:
        print("interrupted: the running points saved a checkpoint; the same command continues the grid",
              file=sys.stderr)
        return 130
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
