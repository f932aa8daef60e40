"""The training loop: `Trainer(cfg).fit()` trains as the composed config (conf/train.yaml) says and returns a summary.

    setup()      accelerator, seed, tokenizer, model, loader, validation data, optimizer, schedule, logger
    resume(path) the checkpoint's model, optimizer, schedule, loader state, RNG, step, tokens and W&B id
    step()       one optimizer step: grad_accum micro steps, clipping, the update (skipped when non-finite)
    log_window() the train/ and perf/ metrics of the steps since the last log (and their line on the console)
    validate()   val/loss (and teacher-forced needle retrieval with data.retrieval_mix on), or the MQAR accuracies
                 for data=mqar (and their line on the console)
    save()       an atomic checkpoint of everything a resumed run needs to continue bit for bit
    fit()        setup, then step / log / validate / save until trainer.max_steps, a stop signal or an early stop
    finish()     the last validation and checkpoint, the final evaluations and the summary

`run(cfg)` is the same as one call; train.py (the Hydra entry) and the in-process callers (tests, benchmarks) use
it. The options are described in docs/configuration.md.
"""
from __future__ import annotations

import math
import resource
import signal
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

import models
from data import build_train_loader, load_tokenizer
from data.mqar import build_test_sets
from data.retrieval_mix import heldout_needle_documents
from eval_suites import mqar
from training.checkpoint import CheckpointManager, init_weights_from
from training.compile import compile_blocks
from training.config import launch_defaults, model_kwargs, runs_dir, validate_train_config
from training.data_hashes import DataHashWriter
from training.evaluation import eval_summary, evaluate_checkpoint, final_eval_configs
from training.fsdp import fsdp_plugin, parallelism_config, set_prefetch
from training.guards import NonFiniteGuard
from training.logging import (
    MetricsLogger,
    peak_flops_per_device,
    read_metrics,
    supersede_after,
    validation_line,
    window_line,
)
from training.optim import build_lr_schedule, build_optimizer, local_grad_norm
from training.phase_timing import PhaseTimer
from training.resume_check import check_resume_config
from training.run_lock import RunLock
from training.validation import (
    DEFAULT_VAL_BATCHES,
    NEEDLE_DOCUMENTS,
    ValidationProgress,
    evaluate_loss,
    evaluate_needles,
    heldout_rows,
    mqar_validation_sets,
    needle_set,
    rank_rows,
)


class StopRequested:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self):
        self.flag = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a worker): no handler
                pass
        return self

    def _handle(self, signum, frame):
        self.flag = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@contextmanager
def no_library_progress_bars():
    """transformers' progress bars off (its "Writing model shards" bar at every checkpoint) and back as they were."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def run(cfg: DictConfig, run_dir: str | Path | None = None, group: str | None = None,
        run_name: str | None = None) -> dict:
    """Train as cfg says; return a summary (final step, losses, checkpoint path)."""
    return Trainer(cfg, run_dir=run_dir, group=group, run_name=run_name).fit()


class Trainer:
    """One training run of the composed config cfg, written to run_dir (default cfg.run_dir, else
    <cfg.paths.runs>/<cfg.name>).

    group and run_name name the W&B run (a sweep's points). Attributes set by setup() are the run's parts
    (accelerator, model, optimizer, scheduler, loader, ckpt, logger) and its state: state holds what a checkpoint
    carries (step, tokens, skipped_steps, wandb_id).
    """

    def __init__(self, cfg: DictConfig, run_dir: str | Path | None = None, group: str | None = None,
                 run_name: str | None = None):
        self.cfg, self.tr = cfg, cfg.trainer
        self.run_dir_arg, self.group, self.run_name = run_dir, group, run_name
        self.lock = None

    # ---- setup -------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Everything the loop needs. The order is part of the contract: the model's initialisation draws first
        from the RNG that set_seed seeds (a resumed run then restores every RNG from its checkpoint)."""
        cfg, tr = self.cfg, self.tr
        validate_train_config(cfg)
        self.run_dir = Path(self.run_dir_arg or cfg.get("run_dir") or runs_dir(cfg) / cfg.name).resolve()

        if tr.num_threads:
            torch.set_num_threads(int(tr.num_threads))
        self.use_cpu = tr.device == "cpu" or (tr.device == "auto" and not torch.cuda.is_available())
        if tr.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but CUDA is not available; use trainer.device=auto or cpu")
        mp = tr.mixed_precision
        if mp == "auto":
            mp = "no" if self.use_cpu else "bf16"
        parallelism = parallelism_config(tr, self.use_cpu)  # hybrid sharding only (accelerate < 1.10 lacks it)
        acc = self.accelerator = Accelerator(cpu=self.use_cpu, mixed_precision=mp,
                                             fsdp_plugin=fsdp_plugin(tr, mp, self.use_cpu),
                                             **({"parallelism_config": parallelism} if parallelism else {}))
        self.world = acc.num_processes
        set_seed(int(cfg.seed), device_specific=False)

        # one live process per run directory (rank 0 holds it for the run's life; docs/robustness.md)
        self.lock = RunLock(self.run_dir).acquire() if acc.is_main_process else None
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep_last=int(tr.keep_last), accelerator=acc)
        self.nonfinite = NonFiniteGuard(tr.get("max_nonfinite_steps", 20), acc.device)
        resume_from = self.ckpt.resolve_resume(str(tr.resume))  # raises before any work if a run would be overwritten
        self.saved_cfg = None
        if resume_from is not None:  # settings that change what the run computes must match the checkpoint's
            self.saved_cfg = OmegaConf.to_container(OmegaConf.load(resume_from / "config.yaml"), resolve=True)
            for line in check_resume_config(self.saved_cfg, OmegaConf.to_container(cfg, resolve=True),
                                            tr.get("resume_override"), defaults=launch_defaults):
                acc.print(f"resume: {line}")

        with acc.main_process_first():  # rank 0 trains/caches the tokenizer, the others then load it
            self.tokenizer = load_tokenizer(OmegaConf.to_container(cfg.tokenizer, resolve=True))
        # Synthetic data (MQAR) defines its own vocabulary; text data uses the tokenizer's.
        vocab_size = int(cfg.data.get("vocab_size") or self.tokenizer.vocab_size)
        model = models.build_model(model_kwargs(cfg.model, vocab_size, self.tokenizer))
        self.data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
        self.is_mqar = self.data_cfg.get("type") == "mqar"
        if tr.get("init_from") and resume_from is None:  # a new run from another run's weights (a curriculum stage)
            # MQAR's ids are its own; text's must be the same tokens
            for line in init_weights_from(model, tr.init_from, OmegaConf.to_container(cfg, resolve=True),
                                          None if self.is_mqar else self.tokenizer):
                acc.print(line)
        elif tr.get("init_from"):
            acc.print(f"init: trainer.init_from is not read: the run resumes from its own checkpoint {resume_from}")
        if tr.gradient_checkpointing:  # transformers 5 renamed the method; call whichever this version has
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        if tr.get("compile"):  # the blocks' training forwards through torch.compile, the kernels' operators opaque
            compile_blocks(model, mode=tr.get("compile_mode"))
        n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = model.num_flops_per_token(int(tr.seq_len))

        self.loader = build_train_loader(self.data_cfg, self.tokenizer, seq_len=int(tr.seq_len),
                                         batch_size=int(tr.batch_size), rank=acc.process_index, world_size=self.world,
                                         seed=int(cfg.seed))
        val_batches = tr.get("val_batches")
        if self.is_mqar:  # validation = accuracy on the fixed MQAR test sets (eval_suites.mqar): all, or a subset
            self.mqar_tests = mqar_validation_sets(build_test_sets(self.data_cfg), val_batches, int(tr.batch_size))
        else:
            self.val_rows = heldout_rows(self.data_cfg, self.tokenizer, int(tr.seq_len),
                                         int(val_batches or DEFAULT_VAL_BATCHES) * int(tr.batch_size))
        self.needles = self._needle_set(int(cfg.seed))

        optimizer = build_optimizer(model, cfg.optim, on_cuda=not self.use_cpu)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if getattr(acc, "is_fsdp2", False):  # the blocks' all-gather prefetching (training.fsdp)
            set_prefetch(self.model, int(tr.get("fsdp_forward_prefetch", 0)), int(tr.get("fsdp_backward_prefetch", 1)))
        self.scheduler = build_lr_schedule(self.optimizer, cfg.optim, int(tr.max_steps))  # once per optimizer step

        self.state = {"step": 0, "tokens": 0, "skipped_steps": 0, "wandb_id": None}
        self.best = {"mqar_acc": None, "step": None}  # the best val/mqar_acc so far (MQAR data)
        self.last_val = self.last_val_step = None  # the latest validation loss during the loop, and its step
        self.stop_metric = tr.get("early_stop_metric")
        self.stopped_by_signal = self.early_stopped = False
        if resume_from is not None:
            self.resume(resume_from)
            self._apply_new_lr()

        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(cfg, self.run_dir / "config.yaml", resolve=True)
        self.logger = MetricsLogger(self.run_dir, cfg, enabled=acc.is_main_process, group=self.group,
                                    resume_id=self.state["wandb_id"], name=self.run_name)
        if self.logger.wandb_run is not None and self.is_mqar:
            self.logger.wandb_run.define_metric("val/mqar_acc", summary="max")  # the W&B summary: the best accuracy
        self.state["wandb_id"] = self.logger.wandb_id
        self.peak = peak_flops_per_device(tr.peak_tflops, acc.device)
        tokens_per_step = int(tr.batch_size) * int(tr.seq_len) * int(tr.grad_accum) * self.world
        if acc.is_main_process:
            acc.print(f"run {self.run_dir} | {cfg.model.name} {n_params / 1e6:.2f}M params | {self.world} process(es) "
                      f"on {acc.device} | {tokens_per_step} tokens/step | precision {mp}")
            acc.print(self._validation_plan(val_batches))

        self.max_steps = int(tr.max_steps)
        self.progress = None
        if acc.is_main_process and tr.progress_bar:
            self.progress = tqdm(total=self.max_steps, initial=self.state["step"], desc="train", dynamic_ncols=True)

        self.phases = PhaseTimer(acc.device, enabled=bool(tr.get("time_phases", False)))
        self.pending_skips = torch.zeros((), dtype=torch.long, device=acc.device)  # skipped steps not yet in state
        self.inner_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        self.skip_on_device = (bool(self.inner_optimizer.defaults.get("fused"))
                               and getattr(acc, "scaler", None) is None)
        # every rank records what it trains on (trainer.data_hashes; checked by python -m training.data_hashes)
        self.hashes = DataHashWriter(self.run_dir, acc.process_index) if tr.get("data_hashes") else None

    def resume(self, path: Path) -> None:
        """Continue from the checkpoint at path; validations logged up to its step count towards the best (MQAR)."""
        self.state.update(self.ckpt.load(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                         loader=self.loader))
        self.accelerator.print(f"resumed from {path} at step {self.state['step']}")
        if self.accelerator.is_main_process:
            supersede_after(self.run_dir / "metrics.jsonl", self.state["step"])
        for row in read_metrics(self.run_dir / "metrics.jsonl"):
            if row.get("step") is not None and row["step"] <= self.state["step"]:
                self._record(row, row["step"], log=False)

    # ---- the loop ----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to trainer.max_steps (or a stop signal, or an early stop); return the run's summary."""
        try:
            self.setup()
            if self.state["step"] == 0:
                self._record(self.validate(), step=0)
            self.model.train()
            self.window = self._new_window()  # after the first validation: its time is not the first window's
            with StopRequested() as stop:
                while self.state["step"] < self.max_steps:
                    self.step()
                    if self._end_of_step(stop):
                        break
                if self.stopped_by_signal:
                    # Still under the handler: a second signal (a sweep or `timeout` passing on its own) must not
                    # kill the run while it writes its summary. A run that ended by itself keeps Ctrl-C for its evals.
                    return self.finish()
            return self.finish()
        finally:
            if self.lock is not None:
                self.lock.release()

    def _end_of_step(self, stop: StopRequested) -> bool:
        """After an optimizer step: log, validate and save on their schedules; True when the run stops here (a stop
        signal on any rank: saved first; or the early-stop metric reached its threshold)."""
        tr, acc, step = self.tr, self.accelerator, self.state["step"]
        if step % int(tr.log_every) == 0 or step == self.max_steps:
            self.log_window()
        if int(tr.val_every) and step % int(tr.val_every) == 0 and step != self.max_steps:
            val = self.validate()
            self.last_val, self.last_val_step = val["val/loss"], step
            self._record(val, step)
            if self.stop_metric:
                if self.stop_metric not in val:
                    raise ValueError(f"trainer.early_stop_metric={self.stop_metric!r} is not a validation metric of "
                                     f"this run; available: {sorted(val)}")
                self.early_stopped = val[self.stop_metric] >= float(tr.get("early_stop_threshold"))
        stop_now = stop.flag
        if self.world > 1:
            stop_now = bool(acc.reduce(torch.tensor(float(stop.flag), device=acc.device), reduction="max") > 0)
        if stop_now:
            self.stopped_by_signal = True
            self.save()
            acc.print(f"stop requested: saved step {step} and exiting")
            return True
        if self.early_stopped:
            acc.print(f"early stop at step {step}: {self.stop_metric} = {val[self.stop_metric]:.4f} >= "
                      f"{float(tr.get('early_stop_threshold'))}")
            return True
        if int(tr.save_every) and step % int(tr.save_every) == 0 and step != self.max_steps:
            self.save()
        return False

    def finish(self) -> dict:
        """The end of a run: a last validation and checkpoint unless a signal stopped it, the final evaluations, the
        summary (returned, and written to run_dir/summary.json and W&B)."""
        tr, acc, state = self.tr, self.accelerator, self.state
        if self.progress is not None:
            self.progress.close()
        final_path = None
        if not self.stopped_by_signal and self.last_val_step != state["step"]:
            val = self.validate()
            self.last_val = val["val/loss"]
            self._record(val, state["step"])
        if not self.stopped_by_signal:
            if self.ckpt.latest_step() == state["step"]:
                final_path = self.ckpt.latest()
            elif tr.save_final:
                final_path = self.save()
        self._fold_skips()
        summary = {"step": state["step"], "tokens": state["tokens"], "skipped_steps": state["skipped_steps"],
                   "val_loss": self.last_val, "checkpoint": str(final_path or self.ckpt.latest() or ""),
                   "run_dir": str(self.run_dir), "stopped_by_signal": self.stopped_by_signal,
                   "malformed_records": self.loader.stats.get("malformed", 0)}
        if self.stop_metric:
            summary["early_stopped"] = self.early_stopped
        if self.best["mqar_acc"] is not None:
            summary.update(best_mqar_acc=self.best["mqar_acc"], best_mqar_acc_step=self.best["step"])
        if not self.stopped_by_signal and final_path is not None:
            self._final_evals(final_path, summary)
        self.logger.finish(summary)
        if hasattr(self.loader, "close"):
            self.loader.close()
        acc.wait_for_everyone()
        if acc.num_processes > 1 and torch.distributed.is_initialized():
            acc.end_training()
        return summary

    def step(self) -> None:
        """One optimizer step over trainer.grad_accum micro batches. A step whose loss or gradient norm is not finite
        (on any rank) updates nothing; the schedule still advances. Losses and counts stay on the device until
        log_window reads them."""
        acc, model, optimizer, phases, window = self.accelerator, self.model, self.optimizer, self.phases, self.window
        accum = int(self.tr.grad_accum)
        step_loss = torch.zeros((), device=acc.device)
        step_tokens = 0  # counted from the batches: MQAR batches are as long as their setting's seq_len
        for micro in range(accum):
            t_wait = time.perf_counter()
            batch = next(self.loader)
            if self.hashes is not None:
                self.hashes.write(self.state["step"] + 1, micro, batch["input_ids"])
            step_tokens += batch["input_ids"].numel() * self.world  # every rank's batch has the same shape
            window["data_wait"] += time.perf_counter() - t_wait
            batch = {k: v.to(acc.device, non_blocking=True) for k, v in batch.items()}
            sync = micro == accum - 1
            with (nullcontext() if sync else acc.no_sync(model)):
                with phases("forward"), acc.autocast():  # explicit: see training.fsdp.fsdp_plugin
                    loss = model(**batch, return_logits=False).loss  # fused LM-head loss: no [tokens, V] logits
                with phases("backward"):
                    acc.backward(loss / accum)
            step_loss += loss.detach() / accum
        with phases("optimizer"):
            max_norm = float(self.cfg.optim.grad_clip) or math.inf
            self.grad_norm = local_grad_norm(acc.clip_grad_norm_(model.parameters(), max_norm), step_loss.device)
            finite = torch.isfinite(step_loss) & torch.isfinite(self.grad_norm)
            if self.world > 1:
                finite = acc.reduce(finite.float(), reduction="min") > 0
            if self.skip_on_device:
                # fused AdamW reads found_inf (as with a GradScaler) and leaves parameters, moments and its
                # step count untouched where it is 1: the skip needs no host sync
                self.inner_optimizer.found_inf, self.inner_optimizer.grad_scale = (~finite).float(), None
                optimizer.step()
                del self.inner_optimizer.found_inf, self.inner_optimizer.grad_scale
            elif bool(finite):
                optimizer.step()
            self.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        self.state["step"] += 1
        self.nonfinite.update(finite, self.state["step"])
        self.state["tokens"] += step_tokens
        window["tokens"] += step_tokens
        window["steps"] += 1
        # summed on the device; read (and the loss reduced across ranks) once per log window
        window["loss"] += torch.where(finite, step_loss, torch.zeros_like(step_loss))
        window["updates"] += finite.long()
        self.pending_skips += (~finite).long()
        if self.progress is not None:
            self.progress.update(1)

    def log_window(self) -> None:
        """Log the train/, perf/ and data/ metrics of the steps since the last log, and start a new window."""
        acc, window, step = self.accelerator, self.window, self.state["step"]
        # the loss read waits for the device: the window's time is taken after it, so work still queued on
        # the GPU when the host reaches this line counts (taken before, tokens/s came out 7-20% high)
        loss_sum = float(acc.reduce(window["loss"], reduction="mean"))
        elapsed = time.perf_counter() - window["t0"]
        tok_s = window["tokens"] / max(elapsed, 1e-9)
        updates = int(window["updates"])
        skipped = self._fold_skips()
        self._check_nonfinite()
        if skipped:
            acc.print(f"steps {step - window['steps'] + 1}-{step}: {skipped} non-finite loss or "
                      f"gradient step(s), updates skipped ({self.state['skipped_steps']} so far)")
        metrics = {
            "train/loss": loss_sum / updates if updates else float("nan"),
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": float(self.grad_norm),
            "train/tokens": self.state["tokens"],
            "train/skipped_steps": self.state["skipped_steps"],
            "perf/tokens_per_s": tok_s,
            "perf/tokens_per_s_per_device": tok_s / self.world,
            "perf/data_wait_s": window["data_wait"],
            "perf/data_wait_frac": window["data_wait"] / max(elapsed, 1e-9),
            "perf/step_time_s": elapsed / window["steps"],
            **self.phases.window_metrics(window["steps"]),  # perf/{forward,backward,optimizer}_s when timed
            "data/malformed_records": self.loader.stats.get("malformed", 0),
        }
        if self.peak:
            metrics["perf/mfu"] = self.flops_per_token * tok_s / self.world / self.peak
        if torch.cuda.is_available() and not self.use_cpu:
            metrics["perf/mem_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            metrics["perf/mem_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        self.logger.log(metrics, step=step)
        self._say(window_line(step, self.max_steps, metrics))
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", tok_s=f"{tok_s:.0f}")
        self.window = self._new_window()

    def validate(self) -> dict:
        """The validation metrics: val/loss, plus val/needle_acc and val/needle_token_acc with data.retrieval_mix on
        (training.validation.evaluate_needles), or val/mqar_acc and val/mqar_acc/<slice> for MQAR data. Its progress
        and its result go to the console."""
        acc, batch_size = self.accelerator, int(self.tr.batch_size)
        t0 = time.perf_counter()
        total = (sum(len(t["inputs"]) for t in self.mqar_tests) if self.is_mqar
                 else len(rank_rows(self.val_rows, acc)) + (len(self.needles["inputs"]) if self.needles else 0))
        progress = ValidationProgress(total, enabled=acc.is_main_process, bar=self.progress is not None,
                                      write=self._say)
        try:
            if self.is_mqar:
                with acc.autocast():
                    val = mqar.metrics(mqar.evaluate(self.model, self.mqar_tests, batch_size, acc.device,
                                                     progress=progress))
            else:
                val = {"val/loss": evaluate_loss(self.model, self.val_rows, batch_size, acc, progress=progress)}
                if self.needles is not None:
                    with acc.autocast():
                        val.update(evaluate_needles(self.model, self.needles, batch_size, acc.device,
                                                    progress=progress))
        finally:
            progress.close()
        self._say(validation_line(self.state["step"], val, time.perf_counter() - t0))
        return val

    def save(self) -> Path:
        """Write a checkpoint of the current step (the skipped-step count folded into the state first); never one
        after trainer.max_nonfinite_steps non-finite steps in a row (NonFiniteLossError instead)."""
        self._fold_skips()
        self._check_nonfinite()
        with no_library_progress_bars():
            return self.ckpt.save(self.model, self.optimizer, self.scheduler, self.loader, self.state, self.cfg,
                                  self.tokenizer)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _say(self, line: str) -> None:
        """A line on the console (main process only): through the progress bar when it is on, so the bar stays
        whole below the lines."""
        if not self.accelerator.is_main_process:
            return
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, flush=True)

    def _validation_plan(self, val_batches) -> str:
        """What each validation evaluates, for the console at start-up."""
        tr = self.tr
        if not self.is_mqar:
            needles = ("" if self.needles is None else
                       f"; retrieval: {len(self.needles['inputs'])} held-out needle documents of "
                       f"{', '.join(sorted(set(self.needles['tasks'])))} (val/needle_acc, val/needle_token_acc)")
            return (f"validation: {len(self.val_rows)} held-out rows of {int(tr.seq_len)} tokens "
                    f"(trainer.val_batches={val_batches or DEFAULT_VAL_BATCHES} batches of {int(tr.batch_size)})"
                    + needles)
        sizes = [len(t["inputs"]) for t in self.mqar_tests]
        if val_batches is None:
            return (f"validation: MQAR, {len(sizes)} test slice(s), {sum(sizes)} examples (every test example, the "
                    f"Zoology protocol; trainer.val_batches=N scores the first N batches of each slice instead)")
        return (f"validation: MQAR, the first {max(sizes)} examples of each of {len(sizes)} test slice(s), "
                f"{sum(sizes)} in all (trainer.val_batches={val_batches}: val/mqar_acc is the accuracy on this "
                f"subset; eval=mqar scores the full test sets)")

    def _needle_set(self, seed: int) -> dict | None:
        """The held-out needle documents of a run with data.retrieval_mix on (else None), their essay haystacks the
        validation rows' text: held-out, as RULER's haystack is."""
        mix = self.data_cfg.get("retrieval_mix") or {}
        if self.is_mqar or not float(mix.get("fraction") or 0):
            return None
        words = " ".join(self.tokenizer.decode(row.tolist()) for row in self.val_rows).split()
        docs = heldout_needle_documents(mix, self.tokenizer, seq_len=int(self.tr.seq_len), seed=seed,
                                        num=NEEDLE_DOCUMENTS, essay_words=words)
        return needle_set(docs, self.tokenizer, int(self.tr.seq_len))

    def _new_window(self) -> dict:
        device = self.accelerator.device
        return {"loss": torch.zeros((), device=device), "updates": torch.zeros((), dtype=torch.long, device=device),
                "steps": 0, "data_wait": 0.0, "t0": time.perf_counter(), "tokens": 0}

    def _apply_new_lr(self) -> None:
        """A resumed schedule keeps the checkpoint's base rate; an optim.lr accepted by trainer.resume_override
        replaces it from this step on (every group scaled alike, the schedule's multiplier unchanged)."""
        old = float(self.saved_cfg.get("optim", {}).get("lr", self.cfg.optim.lr))
        new = float(self.cfg.optim.lr)
        if old == new or old == 0:
            return
        self.scheduler.base_lrs = [base * new / old for base in self.scheduler.base_lrs]
        for group in getattr(self.optimizer, "optimizer", self.optimizer).param_groups:
            group["lr"] *= new / old

    def _check_nonfinite(self) -> None:
        latest = self.ckpt.latest()
        self.nonfinite.check(last_checkpoint=str(latest) if latest else None)

    def _fold_skips(self) -> int:
        """Move the device-side count of skipped steps into state (a host sync: log windows, saves, the end)."""
        n = int(self.pending_skips)
        self.state["skipped_steps"] += n
        self.pending_skips.zero_()
        return n

    def _record(self, val: dict, step: int, log: bool = True) -> None:
        """Log a validation's metrics and keep the best val/mqar_acc."""
        if log:
            self.logger.log(val, step=step)
        acc = val.get("val/mqar_acc")
        if acc is not None and (self.best["mqar_acc"] is None or acc > self.best["mqar_acc"]):
            self.best.update(mqar_acc=acc, step=step)

    def _final_evals(self, final_path: Path, summary: dict) -> None:
        """trainer.final_eval (the eval group) and trainer.final_evals on the final checkpoint, into summary."""
        for eval_name, eval_cfg in final_eval_configs(self.cfg):
            result = evaluate_checkpoint(final_path, eval_cfg, device=self.accelerator.device,
                                         dtype=torch.float32 if self.use_cpu else torch.bfloat16,
                                         wandb_run=self.logger.wandb_run, wandb_prefix=eval_name)
            if eval_name is None:
                summary["eval"] = eval_summary(result)
            else:
                summary.setdefault("evals", {})[eval_name] = eval_summary(result)
