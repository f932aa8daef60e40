"""hilo pretraining entry point.

    python train.py                                   # tiny Transformer on the embedded corpus (CPU or GPU)
    python train.py model=transformer model/size=340m data=long_data_collections trainer.seq_len=16384
    python train.py -m optim.lr=1e-3,3e-3             # a sweep: one job (and one W&B run) per point
    accelerate launch --config_file conf/accelerate/ddp.yaml train.py ...

Hydra composes conf/train.yaml; `run(cfg)` is the loop, callable in-process by tests and notebooks. The trainer's
concerns live in the `training/` package (config checks, optimizer and schedule, checkpoints, logging), shared with
eval.py. Everything a checkpoint needs to continue bit for bit (model, optimizer, schedule, every rank's loader
state and RNG, step, tokens, W&B id) is written atomically; `trainer.resume=auto` picks the newest one.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from training import (
    CheckpointManager,
    DataHashWriter,
    MetricsLogger,
    PhaseTimer,
    build_lr_schedule,
    build_optimizer,
    compile_blocks,
    local_grad_norm,
    peak_flops_per_device,
    validate_train_config,
)


def _model_kwargs(model_cfg: DictConfig, vocab_size: int, tokenizer) -> dict:
    kwargs = OmegaConf.to_container(model_cfg, resolve=True)
    for hydra_only in ("name", "size_name"):
        kwargs.pop(hydra_only, None)
    kwargs["vocab_size"] = vocab_size
    kwargs.setdefault("eos_token_id", tokenizer.eos_id)
    kwargs.setdefault("bos_token_id", tokenizer.bos_id)
    return kwargs


def _val_rows(data_cfg, tokenizer, seq_len: int, num_rows: int) -> torch.Tensor:
    """Held-out rows of seq_len tokens, each cut from one document (never across documents)."""
    from data import iter_heldout_documents

    rows = []
    for doc in iter_heldout_documents(data_cfg, tokenizer, min_tokens=seq_len, max_docs=None):
        for start in range(0, len(doc) - seq_len + 1, seq_len):
            rows.append(doc[start:start + seq_len])
            if len(rows) == num_rows:
                return torch.tensor(rows, dtype=torch.long)
    if not rows:
        raise ValueError(
            f"no held-out document has {seq_len} tokens; lower trainer.seq_len or point data.heldout at longer text")
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, batch_size: int, accelerator) -> float:
    """Mean next-token loss over held-out rows, split across ranks and summed in float64."""
    world, rank = accelerator.num_processes, accelerator.process_index
    usable = (len(rows) // world) * world or len(rows)  # equal work per rank (FSDP forwards are collective)
    mine = rows[:usable][rank::world] if usable >= world else rows
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i in range(0, len(mine), batch_size):
        batch = mine[i:i + batch_size].to(accelerator.device)
        with accelerator.autocast():  # FSDP2 models get no autocast wrapper from accelerate (see fsdp_plugin)
            out = model(input_ids=batch, labels=batch, use_cache=False, return_logits=False)
        n = batch.shape[0] * (batch.shape[1] - 1)
        total[0] += out.loss.double() * n
        total[1] += n
    if world > 1 and usable >= world:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return (total[0] / total[1]).item()


class _StopRequested:
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


def fsdp_plugin(tr, mixed_precision: str, use_cpu: bool):
    """Under `accelerate launch` with an FSDP config, its plugin with hilo's precision policy; None otherwise.

    accelerate's own policy for mixed_precision=bf16 keeps every parameter in bf16 and reduces gradients in bf16: the
    norms' and gates' elementwise math and the gradient sums then round to bf16, and a two-H200 run drifted from
    the one-GPU loss (5.34 against 5.05 at step 50, where DDP gave 5.10). Here gradients reduce in fp32, and
    trainer.fsdp_param_dtype=fp32 (the default) gathers fp32 parameters so autocast computes exactly as on one GPU;
    bf16 halves the all-gather traffic. accelerate wraps a DDP or single-device model's forward in autocast but not
    an FSDP2 model's (it relies on param_dtype), so the loop enters accelerator.autocast() itself: without it the
    fp32-gather run computed in fp32, ten times slower (5.5K tokens/s on two H200s)."""
    if use_cpu or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = torch.bfloat16 if tr.get("fsdp_param_dtype", "fp32") == "bf16" and mixed_precision == "bf16" else None
    return FullyShardedDataParallelPlugin(
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))


def run(cfg: DictConfig, run_dir: str | Path | None = None, group: str | None = None,
        run_name: str | None = None) -> dict:
    """Train as cfg says; return a summary (final step, losses, checkpoint path)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    import models
    from data import build_train_loader, load_tokenizer

    validate_train_config(cfg)
    tr = cfg.trainer
    run_dir = Path(run_dir or cfg.get("run_dir") or REPO_ROOT / "runs" / cfg.name).resolve()

    if tr.num_threads:
        torch.set_num_threads(int(tr.num_threads))
    use_cpu = tr.device == "cpu" or (tr.device == "auto" and not torch.cuda.is_available())
    if tr.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but CUDA is not available; use trainer.device=auto or cpu")
    mp = tr.mixed_precision
    if mp == "auto":
        mp = "no" if use_cpu else "bf16"
    accelerator = Accelerator(cpu=use_cpu, mixed_precision=mp, fsdp_plugin=fsdp_plugin(tr, mp, use_cpu))
    rank, world = accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process
    set_seed(int(cfg.seed), device_specific=False)

    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=int(tr.keep_last), accelerator=accelerator)
    resume_from = ckpt.resolve_resume(str(tr.resume))  # raises before any work if a run would be overwritten

    with accelerator.main_process_first():  # rank 0 trains/caches the tokenizer, the others then load it
        tokenizer = load_tokenizer(OmegaConf.to_container(cfg.tokenizer, resolve=True))
    # Synthetic data (MQAR) defines its own vocabulary; text data uses the tokenizer's.
    vocab_size = int(cfg.data.get("vocab_size") or tokenizer.vocab_size)
    model = models.build_model(_model_kwargs(cfg.model, vocab_size, tokenizer))
    if tr.gradient_checkpointing:  # transformers 5 renamed the method; call whichever this version has
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    if tr.get("compile"):  # the blocks' training forwards through torch.compile, the kernels' operators opaque
        compile_blocks(model, mode=tr.get("compile_mode"))
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = model.num_flops_per_token(int(tr.seq_len))

    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    loader = build_train_loader(data_cfg, tokenizer, seq_len=int(tr.seq_len), batch_size=int(tr.batch_size),
                                rank=rank, world_size=world, seed=int(cfg.seed))
    if data_cfg.get("type") == "mqar":  # validation = accuracy on the fixed MQAR test sets (eval_suites.mqar)
        from data.mqar import build_test_sets
        from eval_suites import mqar

        mqar_tests = build_test_sets(data_cfg)
    else:
        val_rows = _val_rows(data_cfg, tokenizer, int(tr.seq_len), int(tr.val_batches) * int(tr.batch_size))

    def validate() -> dict:
        """The validation metrics: val/loss, plus val/mqar_acc and val/mqar_acc/<slice> for MQAR data."""
        if data_cfg.get("type") == "mqar":
            with accelerator.autocast():
                return mqar.metrics(mqar.evaluate(model, mqar_tests, int(tr.batch_size), accelerator.device))
        return {"val/loss": evaluate_loss(model, val_rows, int(tr.batch_size), accelerator)}

    optimizer = build_optimizer(model, cfg.optim, on_cuda=not use_cpu)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = build_lr_schedule(optimizer, cfg.optim, int(tr.max_steps))  # stepped once per optimizer step

    state = {"step": 0, "tokens": 0, "skipped_steps": 0, "wandb_id": None}
    if resume_from is not None:
        state.update(ckpt.load(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader))
        accelerator.print(f"resumed from {resume_from} at step {state['step']}")

    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    logger = MetricsLogger(run_dir, cfg, enabled=is_main, group=group, resume_id=state["wandb_id"], name=run_name)
    if logger.wandb_run is not None and data_cfg.get("type") == "mqar":
        logger.wandb_run.define_metric("val/mqar_acc", summary="max")  # the W&B summary is the best accuracy
    state["wandb_id"] = logger.wandb_id
    peak = peak_flops_per_device(tr.peak_tflops, accelerator.device)
    tokens_per_step = int(tr.batch_size) * int(tr.seq_len) * int(tr.grad_accum) * world
    if is_main:
        accelerator.print(
            f"run {run_dir} | {cfg.model.name} {n_params / 1e6:.2f}M params | {world} process(es) on "
            f"{accelerator.device} | {tokens_per_step} tokens/step | precision {mp}")

    max_steps = int(tr.max_steps)
    progress = None
    if is_main and tr.progress_bar:
        from tqdm.auto import tqdm
        progress = tqdm(total=max_steps, initial=state["step"], desc="train", dynamic_ncols=True)

    best = {"mqar_acc": None, "step": None}  # the best val/mqar_acc so far (MQAR data)

    def record(val: dict, step: int, log: bool = True) -> None:
        if log:
            logger.log(val, step=step)
        acc = val.get("val/mqar_acc")
        if acc is not None and (best["mqar_acc"] is None or acc > best["mqar_acc"]):
            best.update(mqar_acc=acc, step=step)

    if resume_from is not None:  # validations before the checkpoint count towards the best (not later ones)
        from training.logging import read_metrics

        for row in read_metrics(run_dir / "metrics.jsonl"):
            if row.get("step") is not None and row["step"] <= state["step"]:
                record(row, row["step"], log=False)

    stop_metric, stop_threshold = tr.get("early_stop_metric"), tr.get("early_stop_threshold")
    if state["step"] == 0:
        record(validate(), step=0)

    model.train()
    accum = int(tr.grad_accum)
    phases = PhaseTimer(accelerator.device, enabled=bool(tr.get("time_phases", False)))
    pending_skips = torch.zeros((), dtype=torch.long, device=accelerator.device)  # skipped steps not yet in state

    def fold_skips() -> int:
        """Move the device-side count of skipped steps into state (a host sync: log windows, saves, the end)."""
        n = int(pending_skips)
        state["skipped_steps"] += n
        pending_skips.zero_()
        return n

    inner_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    skip_on_device = bool(inner_optimizer.defaults.get("fused")) and getattr(accelerator, "scaler", None) is None
    def new_window():
        return {"loss": torch.zeros((), device=accelerator.device),
                "updates": torch.zeros((), dtype=torch.long, device=accelerator.device), "steps": 0, "data_wait": 0.0,
                "t0": time.perf_counter(), "tokens": 0}

    window = new_window()
    # every rank records what it trains on (trainer.data_hashes; checked by python -m training.data_hashes)
    hashes = DataHashWriter(run_dir, rank) if tr.get("data_hashes") else None
    last_val = last_val_step = None
    stopped_by_signal = early_stopped = False
    with _StopRequested() as stop:
        while state["step"] < max_steps:
            step_loss = torch.zeros((), device=accelerator.device)
            step_tokens = 0  # counted from the batches: MQAR batches are as long as their setting's seq_len
            for micro in range(accum):
                t_wait = time.perf_counter()
                batch = next(loader)
                if hashes is not None:
                    hashes.write(state["step"] + 1, micro, batch["input_ids"])
                step_tokens += batch["input_ids"].numel() * world  # every rank's batch has the same shape
                window["data_wait"] += time.perf_counter() - t_wait
                batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
                sync = micro == accum - 1
                with (nullcontext() if sync else accelerator.no_sync(model)):
                    with phases("forward"), accelerator.autocast():  # explicit: see fsdp_plugin
                        loss = model(**batch, return_logits=False).loss  # fused LM-head loss: no [tokens, V] logits
                    with phases("backward"):
                        accelerator.backward(loss / accum)
                step_loss += loss.detach() / accum
            with phases("optimizer"):
                max_norm = float(cfg.optim.grad_clip) or math.inf
                grad_norm = local_grad_norm(accelerator.clip_grad_norm_(model.parameters(), max_norm), step_loss.device)
                finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm)
                if world > 1:
                    finite = accelerator.reduce(finite.float(), reduction="min") > 0
                if skip_on_device:
                    # fused AdamW reads found_inf (as with a GradScaler) and leaves parameters, moments and its
                    # step count untouched where it is 1: the skip needs no host sync
                    inner_optimizer.found_inf, inner_optimizer.grad_scale = (~finite).float(), None
                    optimizer.step()
                    del inner_optimizer.found_inf, inner_optimizer.grad_scale
                elif bool(finite):
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            state["tokens"] += step_tokens
            window["tokens"] += step_tokens
            window["steps"] += 1
            # summed on the device; read (and the loss reduced across ranks) once per log window
            window["loss"] += torch.where(finite, step_loss, torch.zeros_like(step_loss))
            window["updates"] += finite.long()
            pending_skips += (~finite).long()
            if progress is not None:
                progress.update(1)

            step = state["step"]
            if step % int(tr.log_every) == 0 or step == max_steps:
                # the loss read waits for the device: the window's time is taken after it, so work still queued on
                # the GPU when the host reaches this line counts (taken before, tokens/s came out 7-20% high)
                loss_sum = float(accelerator.reduce(window["loss"], reduction="mean"))
                elapsed = time.perf_counter() - window["t0"]
                tok_s = window["tokens"] / max(elapsed, 1e-9)
                updates = int(window["updates"])
                skipped = fold_skips()
                if skipped:
                    accelerator.print(f"steps {step - window['steps'] + 1}-{step}: {skipped} non-finite loss or "
                                      f"gradient step(s), updates skipped ({state['skipped_steps']} so far)")
                metrics = {
                    "train/loss": loss_sum / updates if updates else float("nan"),
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/grad_norm": float(grad_norm),
                    "train/tokens": state["tokens"],
                    "train/skipped_steps": state["skipped_steps"],
                    "perf/tokens_per_s": tok_s,
                    "perf/tokens_per_s_per_device": tok_s / world,
                    "perf/data_wait_s": window["data_wait"],
                    "perf/data_wait_frac": window["data_wait"] / max(elapsed, 1e-9),
                    "perf/step_time_s": elapsed / window["steps"],
                    **phases.window_metrics(window["steps"]),  # perf/{forward,backward,optimizer}_s when timed
                    "data/malformed_records": loader.stats.get("malformed", 0),
                }
                if peak:
                    metrics["perf/mfu"] = flops_per_token * tok_s / world / peak
                if torch.cuda.is_available() and not use_cpu:
                    metrics["perf/mem_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                else:
                    import resource
                    metrics["perf/mem_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
                logger.log(metrics, step=step)
                if progress is not None:
                    progress.set_postfix(loss=f"{metrics['train/loss']:.3f}", tok_s=f"{tok_s:.0f}")
                window = new_window()

            if int(tr.val_every) and step % int(tr.val_every) == 0 and step != max_steps:
                val = validate()
                last_val, last_val_step = val["val/loss"], step
                record(val, step)
                if stop_metric:
                    if stop_metric not in val:
                        raise ValueError(f"trainer.early_stop_metric={stop_metric!r} is not a validation metric of "
                                         f"this run; available: {sorted(val)}")
                    early_stopped = val[stop_metric] >= float(stop_threshold)

            stop_now = stop.flag
            if world > 1:
                stop_now = bool(accelerator.reduce(torch.tensor(float(stop.flag), device=accelerator.device),
                                                   reduction="max") > 0)
            if stop_now:
                stopped_by_signal = True
                fold_skips()
                ckpt.save(model, optimizer, scheduler, loader, state, cfg, tokenizer)
                accelerator.print(f"stop requested: saved step {step} and exiting")
                break
            if early_stopped:
                accelerator.print(f"early stop at step {step}: {stop_metric} = {val[stop_metric]:.4f} >= "
                                  f"{float(stop_threshold)}")
                break
            if int(tr.save_every) and step % int(tr.save_every) == 0 and step != max_steps:
                fold_skips()
                ckpt.save(model, optimizer, scheduler, loader, state, cfg, tokenizer)

    if progress is not None:
        progress.close()
    final_path = None
    if not stopped_by_signal and last_val_step != state["step"]:
        val = validate()
        last_val = val["val/loss"]
        record(val, state["step"])
    if not stopped_by_signal:
        if ckpt.latest_step() == state["step"]:
            final_path = ckpt.latest()
        elif tr.save_final:
            fold_skips()
            final_path = ckpt.save(model, optimizer, scheduler, loader, state, cfg, tokenizer)
    fold_skips()
    summary = {"step": state["step"], "tokens": state["tokens"], "skipped_steps": state["skipped_steps"],
               "val_loss": last_val, "checkpoint": str(final_path or ckpt.latest() or ""), "run_dir": str(run_dir),
               "stopped_by_signal": stopped_by_signal, "malformed_records": loader.stats.get("malformed", 0)}
    if stop_metric:
        summary["early_stopped"] = early_stopped
    if best["mqar_acc"] is not None:
        summary.update(best_mqar_acc=best["mqar_acc"], best_mqar_acc_step=best["step"])
    if not stopped_by_signal and final_path is not None:  # trainer.final_eval (the eval group), trainer.final_evals
        from training.evaluation import eval_summary, evaluate_checkpoint, final_eval_configs

        for eval_name, eval_cfg in final_eval_configs(cfg):
            result = evaluate_checkpoint(final_path, eval_cfg, device=accelerator.device,
                                         dtype=torch.float32 if use_cpu else torch.bfloat16,
                                         wandb_run=logger.wandb_run, wandb_prefix=eval_name)
            if eval_name is None:
                summary["eval"] = eval_summary(result)
            else:
                summary.setdefault("evals", {})[eval_name] = eval_summary(result)
    logger.finish(summary)
    if hasattr(loader, "close"):
        loader.close()
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1 and torch.distributed.is_initialized():
        accelerator.end_training()
    return summary


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    group = run_name = None
    if hc.mode == RunMode.MULTIRUN:  # one W&B run per sweep point, grouped by sweep, named by its overrides
        group = cfg.logger.group or Path(hc.sweep.dir).name
        run_name = f"{group}/{hc.job.num}: {' '.join(hc.overrides.task)}"
    summary = run(cfg, run_dir=hc.runtime.output_dir, group=group, run_name=run_name)
    print(json.dumps(summary, indent=None, default=str))
    return summary["val_loss"]  # lets Hydra sweepers minimise it


if __name__ == "__main__":
    main()
