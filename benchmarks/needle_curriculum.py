"""A length curriculum of needle retrieval: per family, train.py stages on RULER needle documents of doubling length,
each from the previous stage's weights (trainer.init_from), then RULER on the last stage; print the tables.

    python benchmarks/needle_curriculum.py --out runs/needle_curriculum --families transformer,mamba2 --jobs 2 \
        [--size 125m] [--lengths 132,256,512,1024,2048] [--batch-sizes 256,128,64,32,16] \
        [--steps 1000,600,600,600,600] [--lr 1e-3] [--family-lr gated_deltanet=5e-4,...] [--threshold 0.9] \
        [--train-tasks niah_single_1] [--eval-lengths 1024,2048,4096] \
        [--eval-tasks niah_single_1,niah_single_2,niah_multikey_1] [--eval-samples 25] \
        [-- trainer.compile=true ...]

Why stages: trained from scratch on long needle documents, a model learns everything in them but the copy of the
needle's digits, and at 512 tokens and beyond that copy had not formed by the end of runs far longer than a short
stage (docs/performance.md#short-needle-documents-only). On 132-token documents it forms within hundreds of steps,
and from those weights it forms again at twice the length in tens to hundreds more; at four times the length in one
step it forms slowly.

Each stage is one `train.py` run in <out>/<family>-T<length>/: every row a needle document of that length of one of
--train-tasks (niah_single_1 by default; data.retrieval_mix.fraction=1.0), an early stop once val/needle_acc
(held-out documents, every answer token top-1) reaches --threshold, and a RULER report on those tasks at the
stage's own length plus RULER_MARGIN (a RULER length
counts the prompt and the 16 tokens of generation budget, so its prompts then stay inside the positions the stage's
documents trained). The first stage warms up for FIRST_WARMUP steps from random weights, later ones for
STAGE_WARMUP from the previous stage's. Overrides after `--` go to every stage, after the curriculum's own (and
those of logger to the RULER report too).

Families run side by side (--jobs at a time, each its stages in order); the sweep's CPU-share rule applies
(benchmarks/mqar_sweep.py). A stage whose summary.json says it ended is skipped; one stopped by a signal resumes from
its checkpoint; a stage that fails ends its family's curriculum (the table says where), and the same command runs it
again from its last checkpoint (with other settings, e.g. a lower --family-lr, remove its directory first: a resumed
run refuses a changed learning rate). SIGTERM or SIGINT stops the
curriculum: each running stage saves a checkpoint, and the same command later continues. Once a family's last stage
has ended, RULER runs on it at --eval-lengths (lengths past the last stage's measure extrapolation) into
<out>/<family>-ruler/ruler.json, kept for later calls. The tables go to <out>/needle_curriculum.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.mqar_sweep import StopFlag, point_env, split_list
from benchmarks.mqar_table import finished, read_summary

TRAIN_TASKS = ("niah_single_1",)  # the default; --train-tasks
RULER_MARGIN = 6      # a stage's own RULER length is its training length plus this
MAX_NEW_TOKENS = 16   # generation budget of every RULER report (the answer is 7 digits, a full stop and EOS)
FIRST_WARMUP = 100
STAGE_WARMUP = 30


def int_list(text: str) -> list[int]:
    return split_list(text, int)


def family_rates(text: str) -> dict[str, float]:
    """'gated_deltanet=5e-4,loglinear_mamba2=5e-4' -> {family: lr}."""
    rates = {}
    for item in split_list(text):
        family, sep, lr = item.partition("=")
        try:
            rates[family.strip()] = float(lr)
        except ValueError:
            sep = ""
        if not sep or not family.strip():
            raise argparse.ArgumentTypeError(f"{item!r}: expected family=lr, e.g. gated_deltanet=5e-4")
    return rates


def stage_name(family: str, length: int) -> str:
    return f"{family}-T{length}"


def stage_command(family: str, size: str, length: int, batch_size: int, steps: int, lr: float, threshold: float,
                  run_dir: Path, init_from: Path | None, extra: list[str], tasks=TRAIN_TASKS) -> list[str]:
    """train.py's command line for one stage (init_from: the previous stage's run directory, None for the first)."""
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), f"model={family}", f"model/size={size}",
           f"trainer.seq_len={length}", f"trainer.batch_size={batch_size}", f"trainer.max_steps={steps}",
           "data.retrieval_mix.fraction=1.0", f"data.retrieval_mix.tasks=[{','.join(tasks)}]", f"optim.lr={lr:g}",
           f"optim.warmup_steps={STAGE_WARMUP if init_from else FIRST_WARMUP}", "trainer.val_every=100",
           "trainer.val_batches=2", "trainer.save_every=200", "trainer.keep_last=1", "trainer.log_every=50",
           "trainer.early_stop_metric=val/needle_acc", f"trainer.early_stop_threshold={threshold:g}",
           "trainer.final_eval=false", "+eval@trainer.final_evals.ruler=ruler",
           f"trainer.final_evals.ruler.lengths=[{length + RULER_MARGIN}]",
           f"trainer.final_evals.ruler.tasks=[{','.join(tasks)}]", "trainer.final_evals.ruler.num_samples=25",
           f"trainer.final_evals.ruler.max_new_tokens={MAX_NEW_TOKENS}", "trainer.progress_bar=false",
           f"hydra.run.dir={run_dir}", f"name={run_dir.name}"]
    if init_from is not None:
        cmd.append(f"trainer.init_from={init_from}")
    return cmd + extra


def ruler_command(last_stage: Path, out_dir: Path, lengths: list[int], tasks: list[str], samples: int,
                  extra: list[str]) -> list[str]:
    """eval.py's command line for the final report; of the overrides after `--` it takes the logger's."""
    logger = [o for o in extra if o.lstrip("+~").startswith("logger")]
    return [sys.executable, str(REPO_ROOT / "eval.py"), f"checkpoint={last_stage}", "eval=ruler",
            f"eval.lengths=[{','.join(map(str, lengths))}]", f"eval.tasks=[{','.join(tasks)}]",
            f"eval.num_samples={samples}", f"eval.max_new_tokens={MAX_NEW_TOKENS}", f"eval.out_dir={out_dir}", *logger]


class Curriculum:
    """The stages and final RULER report of each family, run in order per family, --jobs families at a time."""

    def __init__(self, args, extra: list[str]):
        self.args, self.extra = args, extra
        self.out = args.out.resolve()
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stop: StopFlag | None = None
        self.failed: dict[str, str] = {}  # family -> the step that failed (a stage's or the RULER report's log)

    def run(self) -> bool:
        """Run every family's curriculum; return whether a signal interrupted it."""
        slots = threading.Semaphore(self.args.jobs)
        with StopFlag() as self.stop:
            threads = [threading.Thread(target=self._family, args=(family, slots)) for family in self.args.families]
            for thread in threads:
                thread.start()
            forwarded = False
            while any(t.is_alive() for t in threads):
                if self.stop.set and not forwarded:
                    with self.lock:
                        for proc in self.procs:
                            proc.terminate()  # SIGTERM: the stage saves a checkpoint at its next step
                    forwarded = True
                time.sleep(0.2)
            return self.stop.set

    def _family(self, family: str, slots: threading.Semaphore) -> None:
        with slots:
            prev = None
            for length, batch, steps in zip(self.args.lengths, self.args.batch_sizes, self.args.steps, strict=True):
                run_dir = self.out / stage_name(family, length)
                if not finished(read_summary(run_dir)):
                    lr = self.args.family_lr.get(family, self.args.lr)
                    cmd = stage_command(family, self.args.size, length, batch, steps, lr,
                                        self.args.threshold, run_dir, prev, self.extra, self.args.train_tasks)
                    if not self._call(cmd, run_dir, run_dir / "stage.log", family):
                        return
                prev = run_dir
            report = self.out / f"{family}-ruler"
            if not (report / "ruler.json").is_file():
                cmd = ruler_command(prev, report, self.args.eval_lengths, self.args.eval_tasks, self.args.eval_samples,
                                    self.extra)
                self._call(cmd, report, report / "eval.log", family)

    def _call(self, cmd: list[str], folder: Path, log_path: Path, family: str) -> bool:
        """Run one step of a family's curriculum; False (and no further step) when it failed or a signal came."""
        folder.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log, self.lock:
            if self.stop.set:  # checked under the lock that the stop's forwarding holds: no stage starts after it
                return False
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=point_env(self.args.jobs), stdout=log,
                                    stderr=subprocess.STDOUT)
            self.procs.add(proc)
        code = proc.wait()
        with self.lock:
            self.procs.discard(proc)
        if code != 0 and not self.stop.set:
            self.failed[family] = str(log_path)
            print(f"{family}: failed (exit {code}), see {log_path}", file=sys.stderr)
        return code == 0 and not self.stop.set


def last_needle_validation(run_dir: Path) -> dict:
    """The last record of metrics.jsonl with val/needle_acc ({} when there is none)."""
    last = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and "val/needle_acc" in record:
                last = record
    return last


def stage_rows(out: Path, families: list[str], lengths: list[int]) -> list[dict]:
    """One row per stage that has run (or started): steps, whether it stopped early, its last needle validation and
    its own RULER score."""
    rows = []
    for family in families:
        for length in lengths:
            run_dir = out / stage_name(family, length)
            summary = read_summary(run_dir)
            val = last_needle_validation(run_dir)
            if summary is None and not val:
                continue
            summary = summary or {}
            ruler = (summary.get("evals") or {}).get("ruler") or {}
            state = ("interrupted" if summary.get("stopped_by_signal") else
                     "early stop" if summary.get("early_stopped") else "max steps" if summary else "unfinished")
            rows.append({"family": family, "length": length, "steps": summary.get("step", val.get("step")),
                         "state": state, "needle_acc": val.get("val/needle_acc"),
                         "needle_token_acc": val.get("val/needle_token_acc"), "ruler": ruler.get("average")})
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def tables(out: Path, families: list[str], lengths: list[int], train_tasks=TRAIN_TASKS) -> str:
    """Markdown: the stages, then each family's final RULER report (task x length)."""
    header = ("| family | length | steps | ended by | val/needle_acc | val/needle_token_acc | RULER "
              f"{', '.join(train_tasks)} at length + {RULER_MARGIN} |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in stage_rows(out, families, lengths):
        lines.append(f"| {r['family']} | {r['length']} | {_fmt(r['steps'], 'd')} | {r['state']} | "
                     f"{_fmt(r['needle_acc'], '.3f')} | {_fmt(r['needle_token_acc'], '.3f')} | "
                     f"{_fmt(r['ruler'], '.0f')} |")
    reports = [(f, json.loads((out / f"{f}-ruler" / "ruler.json").read_text())) for f in families
               if (out / f"{f}-ruler" / "ruler.json").is_file()]
    if reports:
        eval_lengths = sorted({int(n) for _, rep in reports for scores in rep["scores"].values() for n in scores})
        lines += ["", "| family | task | " + " | ".join(map(str, eval_lengths)) + " |",
                  "|---|---|" + "---|" * len(eval_lengths)]
        for family, rep in reports:
            for task, scores in rep["scores"].items():
                cells = [_fmt(scores.get(str(n)), ".0f") for n in eval_lengths]
                lines.append(f"| {family} | {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the stages' runs and the tables")
    parser.add_argument("--families", type=split_list, required=True, help="comma-separated conf/model names")
    parser.add_argument("--size", default="125m", help="conf/model/size name")
    parser.add_argument("--lengths", type=int_list, default=[132, 256, 512, 1024, 2048],
                        help="tokens a row, a stage each")
    parser.add_argument("--batch-sizes", type=int_list, default=[256, 128, 64, 32, 16], help="rows a step, per stage")
    parser.add_argument("--steps", type=int_list, default=[1000, 600, 600, 600, 600], help="max steps, per stage")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of every stage")
    parser.add_argument("--family-lr", type=family_rates, default={},
                        help="comma-separated family=lr pairs that replace --lr for those families' stages")
    parser.add_argument("--threshold", type=float, default=0.9, help="early stop at val/needle_acc >= this")
    parser.add_argument("--eval-lengths", type=int_list, default=[1024, 2048, 4096])
    parser.add_argument("--train-tasks", type=split_list, default=list(TRAIN_TASKS),
                        help="the RULER tasks of the training documents (val/needle_acc is over all of them)")
    parser.add_argument("--eval-tasks", type=split_list, default=["niah_single_1", "niah_single_2", "niah_multikey_1"])
    parser.add_argument("--eval-samples", type=int, default=25)
    parser.add_argument("--jobs", type=int, default=1, help="families run at once")
    args = parser.parse_args(argv)
    if not len(args.lengths) == len(args.batch_sizes) == len(args.steps):
        parser.error(f"--lengths, --batch-sizes and --steps give one value a stage: got {len(args.lengths)}, "
                     f"{len(args.batch_sizes)} and {len(args.steps)}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    known = {p.stem for p in (REPO_ROOT / "conf" / "model").glob("*.yaml")}
    unknown = [f for f in [*args.families, *args.family_lr] if f not in known]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; conf/model has {sorted(known)}")
    if set(args.family_lr) - set(args.families):
        parser.error(f"--family-lr names {sorted(set(args.family_lr) - set(args.families))}, not in --families")
    curriculum = Curriculum(args, extra)
    interrupted = curriculum.run()
    text = tables(args.out.resolve(), args.families, args.lengths, args.train_tasks)
    (args.out / "needle_curriculum.md").write_text(text)
    print(text, end="")
    if interrupted:
        print("interrupted: the running stages saved a checkpoint; the same command continues the curriculum",
              file=sys.stderr)
        return 130
    return 1 if curriculum.failed else 0


if __name__ == "__main__":
    sys.exit(main())
