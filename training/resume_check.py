"""Resuming with changed settings: which differences between a checkpoint's config and the new one stop the run.

Settings that decide what the run computes (the model, the data, the tokenizer, the optimiser and its schedule, the
seed, and every trainer setting not listed in MAY_CHANGE: sequence length, precision, ...) must match
the checkpoint's: a difference is blocking, and the run stops with the list unless the user accepts it with
`trainer.resume_override=[key, ...]` (a key or a prefix: `optim.lr`, `optim`) or `trainer.resume_override=all`.
Settings in MAY_CHANGE (how long to train, how often to log, validate and save, the logger, the progress bar, the
final evaluations) are applied and printed. A key that the checkpoint's config lacks (a setting added to hilo since
the checkpoint was written) is no difference when its new value is its default, the value the config files give it
(training.config.launch_defaults), as the older code behaved; it is printed as taken at its default. Lacking with
another value, or with no defaults known, it counts as a difference like any other (docs/robustness.md).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

BLOCKING_PREFIXES = ("model", "data", "tokenizer", "optim", "seed")
MAY_CHANGE = (
    "trainer.max_steps", "trainer.log_every", "trainer.val_every", "trainer.val_batches", "trainer.save_every",
    "trainer.save_final", "trainer.keep_last", "trainer.progress_bar", "trainer.final_eval", "trainer.final_evals",
    "trainer.early_stop_metric", "trainer.early_stop_threshold", "trainer.max_nonfinite_steps",
    "trainer.peak_tflops", "trainer.time_phases", "trainer.data_hashes", "trainer.resume", "trainer.resume_override",
    "trainer.init_from",  # read only when a run starts: a resumed run's weights are its checkpoint's
    "logger", "eval", "name", "run_dir", "paths", "hydra",
    # how the same global batch is computed: its split over processes and micro steps (a resume may change the
    # number of processes: docs/robustness.md), the device, compilation, activation checkpointing, CPU threads
    "trainer.batch_size", "trainer.grad_accum", "trainer.device", "trainer.compile", "trainer.compile_mode",
    "trainer.gradient_checkpointing", "trainer.num_threads",
    # how FSDP shards and gathers the same computation (not its reduce and gather dtypes: they change the numbers)
    "trainer.fsdp_sharding", "trainer.fsdp_shard_size", "trainer.fsdp_forward_prefetch",
    "trainer.fsdp_backward_prefetch",
)
_MISSING = object()


class ResumeConfigError(ValueError):
    """Blocking differences between a checkpoint's config and the resumed run's."""


def _flatten(d, prefix: str = "") -> dict:
    out = {}
    if isinstance(d, Mapping):
        if not d and prefix:
            out[prefix] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = d
    return out


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _show(v) -> str:
    return "(not set)" if v is _MISSING else repr(v)


def _same(x, y) -> bool:
    return x == y and (type(x) is type(y) or {type(x), type(y)} <= {int, float})  # 1 and 1.0 agree


Defaults = Mapping | Callable[[], Mapping | None] | None


def compare_configs(saved: Mapping, new: Mapping, defaults: Defaults = None) -> tuple[list[str], list[str]]:
    """The differences between a checkpoint's resolved config and the new run's, as `key: old -> new` lines:
    (blocking, applied). Both are plain nested dicts (OmegaConf.to_container(cfg, resolve=True)). defaults (the
    same kind of dict, or a function returning one or None, called only when the checkpoint's config lacks a key)
    holds the value each key takes when not overridden: a key the checkpoint lacks whose new value is its default
    is no difference, and comes back in applied as `key: absent from the checkpoint's config, taken at its
    default ...`."""
    a, b = _flatten(saved), _flatten(new)
    if callable(defaults) and b.keys() - a.keys():
        defaults = defaults()
    d = _flatten(defaults) if isinstance(defaults, Mapping) else {}
    blocking, applied = [], []
    for key in sorted(a.keys() | b.keys()):
        old, cur = a.get(key, _MISSING), b.get(key, _MISSING)
        if _same(old, cur):
            continue
        if old is _MISSING and _same(d.get(key, _MISSING), cur):
            applied.append(f"{key}: absent from the checkpoint's config, taken at its default {cur!r}")
            continue
        line = f"{key}: {_show(old)} -> {_show(cur)}"
        if old is _MISSING and key in d:
            line += f" (absent from the checkpoint's config; its default is {d[key]!r})"
        if key == "trainer.max_steps":  # build_lr_schedule decays over max_steps: the rest of the schedule changes
            line += " (the lr schedule's decay is recomputed for the new length from this step on)"
        (applied if _under(key, MAY_CHANGE) and not _under(key, BLOCKING_PREFIXES) else blocking).append(line)
    return blocking, applied


def _override_keys(override) -> list[str] | str:
    if override is None or override in ("", "none", "null", False):
        return []
    if isinstance(override, str):
        return "all" if override == "all" else [k.strip() for k in override.split(",") if k.strip()]
    keys = [str(k) for k in override]
    return "all" if "all" in keys else keys


def check_resume_config(saved: Mapping, new: Mapping, override=None, defaults: Defaults = None) -> list[str]:
    """compare_configs, then the rule: blocking differences not accepted by `override` (trainer.resume_override: a
    list of keys or prefixes, a comma-separated string, or "all") raise ResumeConfigError listing them. Returns the
    lines to print: the applied differences (and the keys taken at their defaults), then the accepted blocking ones
    marked `(accepted by trainer.resume_override)`."""
    blocking, applied = compare_configs(saved, new, defaults)
    keys = _override_keys(override)
    accepted = blocking if keys == "all" else [line for line in blocking if _under(line.split(": ", 1)[0], keys)]
    refused = [line for line in blocking if line not in accepted]
    if refused:
        raise ResumeConfigError(
            "the checkpoint was written with other settings, and these change what the run computes:\n  "
            + "\n  ".join(refused)
            + "\nResume with the checkpoint's settings, accept the differences with trainer.resume_override=["
            + ",".join(line.split(": ", 1)[0] for line in refused)
            + "] (or trainer.resume_override=all), or start a new run (trainer.resume=none name=<new name>)")
    return applied + [f"{line} (accepted by trainer.resume_override)" for line in accepted]
