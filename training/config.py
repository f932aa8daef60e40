"""Checks of the composed training config (a bad value fails at start-up with the key, the value and the fix), the
run directory's anchor (conf/paths/default.yaml) and the config the files give a launch (its defaults)."""
from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .compile import COMPILE_MODES
from .fsdp import REDUCE_DTYPES, SHARDINGS

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
# ${hilo.root:} in conf/paths/default.yaml: the checkout, absolute. Registered at import, before Hydra composes
# (train.py and eval.py import this module first).
if not OmegaConf.has_resolver("hilo.root"):
    OmegaConf.register_new_resolver("hilo.root", lambda: str(REPO_ROOT))
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
    "optim.frozen": (lambda v: v is None or (OmegaConf.is_list(v) or isinstance(v, (list, tuple))) and all(
        isinstance(p, str) and p for p in v), "a list of parameter-name patterns such as ['*.mixer.L'] (or [])"),
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
    "trainer.fsdp_reduce_dtype": (lambda v: v is None or v in REDUCE_DTYPES, "fp32 or bf16"),
    "trainer.fsdp_sharding": (lambda v: v is None or v in SHARDINGS, " or ".join(SHARDINGS)),
    "trainer.fsdp_shard_size": (lambda v: v is None or (_is_int(v) and v >= 2),
                                "null (the processes of one node) or an integer >= 2"),
    "trainer.fsdp_forward_prefetch": (lambda v: v is None or (_is_int(v) and v >= 0),
                                      "an integer >= 0 (0: FSDP2's default)"),
    "trainer.fsdp_backward_prefetch": (lambda v: v is None or (_is_int(v) and v >= 1),
                                       "an integer >= 1 (1: FSDP2's default)"),
    "trainer.gradient_checkpointing": (lambda v: v is None or isinstance(v, bool), "true or false"),
    "trainer.max_nonfinite_steps": (lambda v: v is None or (_is_int(v) and v >= 1), "null or an integer >= 1"),
    "trainer.init_from": (lambda v: v is None or (isinstance(v, str) and v != ""),
                          "null or a checkpoint (or run) directory whose weights the new run starts from"),
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
    if OmegaConf.select(cfg, "trainer.fsdp_shard_size") is not None and \
            (OmegaConf.select(cfg, "trainer.fsdp_sharding") or "full") != "hybrid":
        problems.append("trainer.fsdp_shard_size is set but trainer.fsdp_sharding is not hybrid: add "
                        "trainer.fsdp_sharding=hybrid (or drop the size)")
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
    size_name), the vocabulary size, and the tokenizer's eos / bos / pad ids unless the config sets them (pad is
    eos for a tokenizer without a pad token, as the checkpoint's transformers tokenizer files say:
    docs/checkpoints.md)."""
    kwargs = OmegaConf.to_container(model_cfg, resolve=True)
    for hydra_only in ("name", "size_name"):
        kwargs.pop(hydra_only, None)
    kwargs["vocab_size"] = vocab_size
    kwargs.setdefault("eos_token_id", tokenizer.eos_id)
    kwargs.setdefault("bos_token_id", tokenizer.bos_id)
    kwargs.setdefault("pad_token_id", tokenizer.pad_id)
    return kwargs


def runs_dir(cfg: DictConfig) -> Path:
    """The directory that holds the runs: cfg.paths.runs, absolute (a config without paths: <checkout>/runs)."""
    runs = OmegaConf.select(cfg, "paths.runs")
    return Path(runs).absolute() if runs is not None else REPO_ROOT / "runs"


def anchor_paths(cfg: DictConfig) -> None:
    """Make cfg.paths.runs absolute against the launch directory, once, at the entry point: Hydra took the run
    directory (hydra.run.dir = ${paths.runs}/...) against the same directory, and the run's config.yaml then
    records where the run lives. An empty value and a leading `~` (which Hydra never expands) are refused."""
    runs = OmegaConf.select(cfg, "paths.runs")
    if runs is None:
        return
    runs = str(runs)
    if not runs.strip():
        raise ConfigError("paths.runs is empty (from paths.runs= or an empty HILO_RUNS): give the directory that "
                          "holds the runs, e.g. paths.runs=/scratch/me/runs, or unset HILO_RUNS for <checkout>/runs")
    if runs.startswith("~"):
        raise ConfigError(f"paths.runs={runs!r}: `~` is not expanded in a Hydra override; write the absolute path, "
                          f"e.g. paths.runs=$HOME{runs[1:]}")
    cfg.paths.runs = str(Path(runs).absolute())


def locate_checkpoint(value: str, runs: str | Path) -> Path:
    """eval.py's checkpoint=...: a path (absolute, or relative to the working directory) that exists, else a run name
    or a path under `runs` (paths.runs). FileNotFoundError naming both places when neither exists."""
    path = Path(str(value))
    if path.is_absolute() or path.exists():
        return path
    under = Path(runs) / path
    if under.exists():
        return under
    raise FileNotFoundError(f"checkpoint={value!r} does not exist: neither {path.absolute()} nor {under} (under "
                            f"paths.runs); pass a run name, a run directory or a checkpoint directory "
                            f"(<run dir>/checkpoints/step_XXXXXXXX)")


def _is_group(key: str) -> bool:
    return (CONF_DIR / key).is_dir()


def composed_defaults(overrides: list[str], config_name: str = "train") -> dict:
    """The config the files give a launch, resolved: `config_name` composed with the config-group choices among
    `overrides` (model=..., model/size=..., data=..., experiment=..., +model/mqar=..., +eval@trainer.final_evals.x=...)
    and none of its key=value overrides. Its values are the defaults of that launch's groups."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = [o.input_line for o in OverridesParser.create().parse_overrides(list(overrides))
              if _is_group(o.key_or_group)]
    if GlobalHydra.instance().is_initialized():  # inside train.py's @hydra.main: its loader reads conf/
        cfg = compose(config_name=config_name, overrides=groups)
    else:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=groups)
    return OmegaConf.to_container(cfg, resolve=True)


def launch_defaults() -> dict | None:
    """composed_defaults of the running Hydra launch (train.py: its group choices are in hydra.overrides.task);
    None outside one (run(cfg) called in-process), where the choices behind cfg are unknown."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    return composed_defaults(list(hc.overrides.task), config_name=hc.job.config_name or "train")
