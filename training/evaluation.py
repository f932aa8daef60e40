"""Evaluate a saved checkpoint with an eval suite: shared by eval.py and the trainer's final evaluation."""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf

from training.checkpoint import load_checkpoint_model, load_checkpoint_tokenizer, resolve_checkpoint

SUITES = ("ppl_by_position", "ruler", "mqar", "lm_harness")
log = logging.getLogger(__name__)
_SHOWN_KEYS = 20


class PartialWeightsError(ValueError):
    """A checkpoint's weights do not match its model: some are missing, unexpected or of another shape."""


def load_model_checked(checkpoint, *, dtype: torch.dtype = torch.float32, allow_partial_weights: bool = False):
    """The checkpoint's model, refused (PartialWeightsError listing the keys) when any weight of the model is
    missing from model/*.safetensors, any saved tensor is unexpected, or a shape does not match: from_pretrained
    would initialise those weights randomly and the evaluation would score a model that was never trained. With
    ``allow_partial_weights`` the model is returned after a loud warning instead."""
    ckpt = resolve_checkpoint(checkpoint)
    model, info = load_checkpoint_model(ckpt, dtype=dtype, output_loading_info=True)
    problems = {kind: sorted(map(str, info.get(f"{kind}_keys") or ())) for kind in ("missing", "unexpected",
                                                                                    "mismatched")}
    if not any(problems.values()):
        return model
    lines = [f"  {kind} ({len(keys)}): {', '.join(keys[:_SHOWN_KEYS])}" + (" ..." if len(keys) > _SHOWN_KEYS else "")
             for kind, keys in problems.items() if keys]
    what = (f"the weights in {ckpt / 'model'} do not match the model its config.json builds ("
            f"{type(model).__name__}):\n" + "\n".join(lines))
    if not allow_partial_weights:
        raise PartialWeightsError(f"{what}\nrefusing to evaluate: missing weights would be random. Point "
                                  f"checkpoint= at a checkpoint of this model, or pass eval.allow_partial_weights=true "
                                  f"to score it anyway")
    message = f"{what}\nEVALUATING ANYWAY (eval.allow_partial_weights=true): missing weights are RANDOM"
    log.warning(message)
    warnings.warn(message, stacklevel=2)
    return model


def final_eval_configs(cfg) -> list[tuple[str | None, object]]:
    """The evaluations the trainer runs on its final checkpoint, in order, as (name, eval config) pairs:
    (None, cfg.eval) when trainer.final_eval is true (the eval group's one suite, summary["eval"]), then every entry
    of trainer.final_evals, a mapping name -> eval config composed from conf/eval/*.yaml (summary["evals"][name]),
    e.g. `- /eval@trainer.final_evals.ruler: ruler` in an experiment's defaults list. Configs without
    trainer.final_evals (written before it existed) give the eval group's suite alone."""
    tr = cfg.trainer
    pairs = [(None, cfg.eval)] if tr.get("final_eval") else []
    pairs += [(str(name), eval_cfg) for name, eval_cfg in (tr.get("final_evals") or {}).items()]
    return pairs


def eval_summary(result: dict) -> dict:
    """The headline of an evaluation result for a training summary: ppl (ppl_by_position), average (ruler), acc
    (mqar) or metrics (lm_harness), and the report paths."""
    return {**{key: result[key] for key in ("ppl", "average", "acc", "metrics") if key in result},
            "json": result.get("json_path"), "png": result.get("png_path")}


def evaluate_checkpoint(checkpoint, eval_cfg, *, device: torch.device, dtype: torch.dtype = torch.float32,
                        data_cfg=None, wandb_run=None, wandb_prefix: str | None = None) -> dict:
    """Run eval_cfg.suite on a checkpoint (or a run directory's newest one); write JSON + PNG; return the result.

    The tokenizer comes from the checkpoint, the held-out documents from data_cfg or else from the checkpoint's
    own training config. A model whose saved weights do not match it is refused (load_model_checked) unless
    eval_cfg.allow_partial_weights is true. Reports go to eval_cfg.out_dir or <run dir>/eval/<suite>_T<seq_len>/. W&B keys start with
    wandb_prefix (None: the suite's name; "eval" for mqar), so several evaluations of one run keep apart."""
    from data import iter_heldout_documents
    from eval_suites import ppl_by_position

    if eval_cfg.suite not in SUITES:
        raise ValueError(f"eval={eval_cfg.suite!r} is not a known suite; choose one of {', '.join(SUITES)}")
    ckpt = resolve_checkpoint(checkpoint)
    train_cfg = OmegaConf.load(ckpt / "config.yaml")
    tokenizer = load_checkpoint_tokenizer(ckpt)
    model = load_model_checked(ckpt, dtype=dtype,
                               allow_partial_weights=bool(eval_cfg.get("allow_partial_weights", False)))
    model = model.to(device).eval()
    if eval_cfg.suite == "ruler":
        return _evaluate_ruler(ckpt, train_cfg, model, tokenizer, eval_cfg, device=device, wandb_run=wandb_run,
                               wandb_prefix=wandb_prefix or "ruler")
    if eval_cfg.suite == "lm_harness":
        return _evaluate_lm_harness(ckpt, train_cfg, model, tokenizer, eval_cfg, device=device, wandb_run=wandb_run,
                                    wandb_prefix=wandb_prefix or "lm_harness")
    if eval_cfg.suite == "mqar":
        return _evaluate_mqar(ckpt, train_cfg, model, eval_cfg, data_cfg, device=device, wandb_run=wandb_run,
                              wandb_prefix=wandb_prefix or "eval")
    data = OmegaConf.to_container(data_cfg if data_cfg is not None else train_cfg.data, resolve=True)
    seq_len = int(eval_cfg.seq_len)
    docs = list(iter_heldout_documents(data, tokenizer, min_tokens=seq_len + 1, max_docs=int(eval_cfg.num_documents)))
    result = ppl_by_position.evaluate(model, docs, seq_len=seq_len, batch_size=int(eval_cfg.batch_size),
                                      device=device, train_len=int(train_cfg.trainer.seq_len),
                                      smooth_window=eval_cfg.get("smooth_window"))
    result["checkpoint"] = str(ckpt)
    out_dir = Path(eval_cfg.out_dir) if eval_cfg.get("out_dir") else (
        ckpt.parent.parent / "eval" / f"{eval_cfg.suite}_T{seq_len}")
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if is_main:
        json_path, png_path = ppl_by_position.write_report(result, out_dir, title=f"{train_cfg.name} ({ckpt.name})")
        result["json_path"], result["png_path"] = str(json_path), str(png_path)
        if wandb_run is not None:
            ppl_by_position.log_to_wandb(result, wandb_run, prefix=wandb_prefix or "ppl_by_position")
    return result


def _evaluate_ruler(ckpt: Path, train_cfg, model, tokenizer, eval_cfg, *, device: torch.device, wandb_run,
                    wandb_prefix: str) -> dict:
    """RULER NIAH on a loaded checkpoint; reports go to eval_cfg.out_dir or <run dir>/eval/ruler_T<lengths>/."""
    from eval_suites import ruler

    lengths = [int(length) for length in eval_cfg.lengths]
    haystack = eval_cfg.get("haystack")
    result = ruler.evaluate(model, tokenizer, lengths=lengths, tasks=list(eval_cfg.tasks),
                            num_samples=int(eval_cfg.num_samples),
                            haystack=OmegaConf.to_container(haystack) if OmegaConf.is_config(haystack) else haystack,
                            haystack_field=str(eval_cfg.get("haystack_field", "text")),
                            max_new_tokens=int(eval_cfg.max_new_tokens), seed=int(eval_cfg.seed),
                            batch_size=int(eval_cfg.get("batch_size", 8)), device=device)
    result["checkpoint"] = str(ckpt)
    out_dir = Path(eval_cfg.out_dir) if eval_cfg.get("out_dir") else (
        ckpt.parent.parent / "eval" / f"ruler_T{'-'.join(map(str, lengths))}")
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if is_main:
        json_path, png_path = ruler.write_report(result, out_dir, title=f"RULER NIAH: {train_cfg.name} ({ckpt.name})")
        result["json_path"], result["png_path"] = str(json_path), str(png_path)
        if wandb_run is not None:
            ruler.log_to_wandb(result, wandb_run, prefix=wandb_prefix)
    return result


def _evaluate_mqar(ckpt: Path, train_cfg, model, eval_cfg, data_cfg, *, device: torch.device, wandb_run,
                   wandb_prefix: str) -> dict:
    """MQAR accuracy on the test sets of data_cfg, else of the checkpoint's training data (both must be type mqar);
    the report goes to eval_cfg.out_dir or <run dir>/eval/mqar/."""
    from data.mqar import build_test_sets
    from eval_suites import mqar

    data = OmegaConf.to_container(data_cfg if data_cfg is not None else train_cfg.data, resolve=True)
    if data.get("type") != "mqar":
        raise ValueError(f"eval=mqar needs MQAR data (type: mqar); the data config is {data.get('name')!r}: "
                         f"evaluate a checkpoint trained with data=mqar, or pass data=<an MQAR data config>")
    result = mqar.evaluate(model, build_test_sets(data), batch_size=int(eval_cfg.batch_size), device=device)
    result["checkpoint"] = str(ckpt)
    out_dir = Path(eval_cfg.out_dir) if eval_cfg.get("out_dir") else ckpt.parent.parent / "eval" / "mqar"
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if is_main:
        result["json_path"] = str(mqar.write_report(result, out_dir))
        if wandb_run is not None:
            wandb_run.summary.update(mqar.metrics(result, prefix=wandb_prefix))
    return result


def _evaluate_lm_harness(ckpt: Path, train_cfg, model, tokenizer, eval_cfg, *, device: torch.device, wandb_run,
                         wandb_prefix: str) -> dict:
    """lm-evaluation-harness tasks on a loaded checkpoint; rows are at most eval_cfg.max_length tokens (null: the
    checkpoint's training length); the report goes to eval_cfg.out_dir or <run dir>/eval/lm_harness/."""
    from eval_suites import lm_harness

    max_length = eval_cfg.get("max_length") or int(train_cfg.trainer.seq_len)
    include_path = eval_cfg.get("include_path")
    result = lm_harness.evaluate(
        model, tokenizer, tasks=list(eval_cfg.tasks), max_length=int(max_length), batch_size=int(eval_cfg.batch_size),
        max_gen_toks=int(eval_cfg.max_gen_toks), num_fewshot=eval_cfg.get("num_fewshot"), limit=eval_cfg.get("limit"),
        include_path=list(include_path) if OmegaConf.is_list(include_path) else include_path,
        log_samples=bool(eval_cfg.get("log_samples", False)), bootstrap_iters=int(eval_cfg.bootstrap_iters),
        seed=int(eval_cfg.seed), device=device)
    result["checkpoint"] = str(ckpt)
    out_dir = Path(eval_cfg.out_dir) if eval_cfg.get("out_dir") else ckpt.parent.parent / "eval" / "lm_harness"
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if is_main:
        result["json_path"] = str(lm_harness.write_report(result, out_dir))
        if wandb_run is not None:
            lm_harness.log_to_wandb(result, wandb_run, prefix=wandb_prefix)
    return result
