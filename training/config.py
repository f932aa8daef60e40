"""Checks of the composed training config: a bad value fails at start-up with the key, the value and the fix."""
from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .compile import COMPILE_MODES

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# groups whose keys are fixed by their one config file: a key added behind `+` that the file lacks is a typo
_FIXED_GROUPS = {"trainer": CONF_DIR / "trainer" / "default.yaml", "optim": CONF_DIR / "optim" / "adamw.yaml"}


class ConfigError(ValueError):
    pass


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# key -> (predicate, what is expected)
_CHECKS = {
    "trainer.seq_len": (lambda v: _is_int(v) and v >= 2, "an integer >= 2"),
    "trainer.batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "trainer.grad_accum": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "trainer.max_steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "trainer.log_every": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "trainer.val_every": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 disables)"),
    "trainer.val_batches": (lambda v: v is None or (_is_int(v) and v >= 1),
                            "null (8 batches; MQAR: every test example) or an integer >= 1"),
    "trainer.save_every": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: final checkpoint only)"),
    "trainer.keep_last": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "trainer.device": (lambda v: v in ("auto", "cpu", "cuda"), "one of auto, cpu, cuda"),
    "trainer.mixed_precision": (lambda v: v in ("auto", "no", "bf16", "fp16"), "one of auto, no, bf16, fp16"),
    "trainer.fsdp_param_dtype": (lambda v: v in ("fp32", "bf16"), "fp32 or bf16"),
    "trainer.num_threads": (lambda v: v is None or (_is_int(v) and v >= 1), "null or an integer >= 1"),
    "trainer.peak_tflops": (lambda v: v == "auto" or v is None or (_is_num(v) and v > 0),
                            "auto, null or a positive number (TFLOP/s per device)"),
    "trainer.resume": (lambda v: isinstance(v, str) and v != "", "auto, none or a checkpoint directory"),
    "optim.lr": (lambda v: _is_num(v) and v > 0, "a positive number"),
    "optim.betas": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_num(b) and 0 <= b < 1 for b in v),
                    "a list of two numbers in [0, 1)"),
    "optim.eps": (lambda v: _is_num(v) and v > 0, "a positive number"),
    "optim.weight_decay": (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    "optim.grad_clip": (lambda v: _is_num(v) and v >= 0, "a number >= 0 (0 disables clipping)"),
    "optim.schedule": (lambda v: v in ("cosine", "wsd", "constant"), "one of cosine, wsd, constant"),
    "optim.warmup_steps": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "optim.min_lr_ratio": (lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "optim.decay_fraction": (lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "seed": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
}


# Keys that configs written before they existed may lack: checked only when present.
_OPTIONAL_CHECKS = {
    "trainer.early_stop_metric": (lambda v: v is None or (isinstance(v, str) and v != ""),
                                  "null or a validation metric name such as val/mqar_acc"),
    "trainer.early_stop_threshold": (lambda v: v is None or _is_num(v), "null or a number"),
    "trainer.time_phases": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "trainer.compile": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "trainer.compile_mode": (lambda v: v is None or v in COMPILE_MODES, "null, " + " or ".join(COMPILE_MODES)),
    "trainer.data_hashes": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "trainer.max_nonfinite_steps": (lambda v: v is None or (_is_int(v) and v >= 1), "null or an integer >= 1"),
    "trainer.resume_override": (lambda v: v is None or isinstance(v, str) or (
        OmegaConf.is_list(v) and all(isinstance(k, str) for k in v)), "null, all, or a list of keys such as [optim.lr]"),
}


def validate_train_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming every key whose value is missing or of the wrong kind."""
    problems = []
    for key, (ok, expected) in _OPTIONAL_CHECKS.items():
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            problems.append(f"{key}={value!r} is invalid: expected {expected} (override it as {key}=...)")
    if OmegaConf.select(cfg, "trainer.compile_mode") is not None and not OmegaConf.select(cfg, "trainer.compile"):
        problems.append("trainer.compile_mode is set but trainer.compile is false: add trainer.compile=true (or drop "
                        "the mode)")
    if OmegaConf.select(cfg, "trainer.early_stop_metric") and OmegaConf.select(cfg, "trainer.early_stop_threshold") \
            is None:
        problems.append("trainer.early_stop_metric is set but trainer.early_stop_threshold is null: give the value "
                        "at which to stop (e.g. trainer.early_stop_threshold=0.99)")
    final_evals = OmegaConf.select(cfg, "trainer.final_evals")
    if final_evals is not None:  # checked at start-up, not after the training steps
        from training.evaluation import SUITES

        if not isinstance(final_evals, DictConfig):
            problems.append(f"trainer.final_evals={final_evals!r} is invalid: expected a mapping name -> eval config "
                            f"(e.g. +eval@trainer.final_evals.ruler=ruler)")
        else:
            for name, eval_cfg in final_evals.items():
                suite = eval_cfg.get("suite") if isinstance(eval_cfg, DictConfig) else None
                if suite not in SUITES:
                    problems.append(f"trainer.final_evals.{name} has suite={suite!r}: expected an eval config with "
                                    f"suite one of {', '.join(SUITES)} (+eval@trainer.final_evals.{name}=<suite>)")
    for group, path in _FIXED_GROUPS.items():
        section = cfg.get(group)
        if not isinstance(section, DictConfig) or not path.is_file():
            continue
        known = set(OmegaConf.load(path).keys())
        for key in section:
            if key not in known:
                near = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"did you mean {group}.{near[0]}?" if near else f"the keys are listed in {path.name}"
                problems.append(f"{group}.{key} is not a setting ({hint}); a key added with `+` that hilo does not "
                                f"read would be ignored")
    for key, (ok, expected) in _CHECKS.items():
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            problems.append(f"{key} is missing (expected {expected})")
            continue
        value = OmegaConf.select(cfg, key)
        if isinstance(value, DictConfig) or OmegaConf.is_list(value):
            value = OmegaConf.to_container(value, resolve=True)
        if not ok(value):
            problems.append(f"{key}={value!r} is invalid: expected {expected} (override it as {key}=...)")
    if problems:
        raise ConfigError("bad training config:\n  " + "\n  ".join(problems))


def model_kwargs(model_cfg: DictConfig, vocab_size: int, tokenizer) -> dict:
    """models.build_model's keyword arguments from the model group: its HiloConfig keys (not Hydra's name and
    size_name), the vocabulary size, and the tokenizer's eos / bos ids unless the config sets them."""
    kwargs = OmegaConf.to_container(model_cfg, resolve=True)
    for hydra_only in ("name", "size_name"):
        kwargs.pop(hydra_only, None)
    kwargs["vocab_size"] = vocab_size
    kwargs.setdefault("eos_token_id", tokenizer.eos_id)
    kwargs.setdefault("bos_token_id", tokenizer.bos_id)
    return kwargs
