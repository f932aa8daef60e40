"""Whole checkpoint directories between hilo and transformers (docs/checkpoints.md), over the weight mappings of
models/convert.py:

    python -m training.convert export runs/<name> <out dir> [--format auto|llama|mamba2]
    python -m training.convert import <transformers Llama or Mamba-2 dir> <out dir>

export_checkpoint writes a plain transformers directory (LlamaForCausalLM or Mamba2ForCausalLM: config.json,
safetensors weights, generation_config.json, the tokenizer as tokenizer.json) that loads with no hilo import;
import_checkpoint writes a hilo model directory (save_pretrained of HiloForCausalLM, the source's tokenizer files
beside it). A ConversionError names what cannot be mapped; the command prints it on one line and exits with 2.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from data.tokenizer import TokenizerConversionError
from models.config import HiloConfig
from models.convert import (
    ConversionError,
    hilo_config_from_llama,
    hilo_config_from_mamba2,
    hilo_to_llama_state_dict,
    hilo_to_mamba2_state_dict,
    llama_config_from_hilo,
    llama_to_hilo_state_dict,
    mamba2_config_from_hilo,
    mamba2_to_hilo_state_dict,
)
from training.checkpoint import TOKENIZER_FILE, resolve_checkpoint, write_hf_tokenizer

EXPORT_FORMATS = ("auto", "llama", "mamba2")
EXPORTABLE = ("hilo exports two families, the ones with a transformers CausalLM of the same architecture: the "
              "transformer (mixer=attention, operator=null) as LlamaForCausalLM and mamba2 with mlp=false as "
              "Mamba2ForCausalLM")
# the files of a transformers tokenizer directory (copied on import)
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                       "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"output directory {str(out)!r} exists and is not empty; pick another one or "
                                  f"pass overwrite=True (--overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained directory (*.safetensors, else pytorch_model*.bin), dtypes as saved."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(f))
        return weights
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{str(model_dir)!r} holds no weights (*.safetensors or pytorch_model*.bin)")
    weights = {}
    for f in files:
        weights.update(torch.load(f, map_location="cpu", weights_only=True))
    return weights


def _save_model(model_cls, config, state_dict: dict[str, torch.Tensor], out: Path) -> None:
    """save_pretrained of model_cls(config) holding state_dict's tensors (built on the meta device: nothing is
    initialised, every parameter comes from state_dict)."""
    dtypes = {v.dtype for v in state_dict.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    with torch.device("meta"):
        model = model_cls(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)


def _hilo_source(src: str | Path) -> tuple[Path, Path | None]:
    """(model dir, hilo tokenizer dir or None) of a hilo model dir, a checkpoint (step) dir or a run dir (its
    newest checkpoint, as eval.py finds it)."""
    p = Path(src).expanduser()
    if (p / "config.json").is_file():  # a model dir: the tokenizer is the checkpoint's, beside it
        tok = p.parent / "tokenizer"
        return p, tok if (tok / TOKENIZER_FILE).is_file() else None
    ckpt = resolve_checkpoint(p)  # a clear FileNotFoundError for anything else
    tok = ckpt / "tokenizer"
    return ckpt / "model", tok if (tok / TOKENIZER_FILE).is_file() else None


def _export_format(config: HiloConfig, fmt: str) -> str:
    if fmt not in EXPORT_FORMATS:
        raise ConversionError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if fmt != "auto":
        return fmt
    if config.mixer == "attention" and config.operator is None:
        return "llama"
    if config.mixer == "mamba2" and config.operator is None:
        return "mamba2"
    what = f"mixer={config.mixer}" + ("" if config.operator is None else f" operator={config.operator}")
    why = "transformers has no CausalLM that computes it"
    if config.main_mixer == "gated_deltanet":
        why += (" (hilo's gated_deltanet maps to Qwen3-Next's GDN layers only, at layer level: the rest of a "
                "Qwen3-Next model is not hilo's)")
    raise ConversionError(f"cannot export a model with {what}: {EXPORTABLE}; {why}")


def export_checkpoint(src: str | Path, out: str | Path, format: str = "auto", *, overwrite: bool = False) -> dict:
    """Write a hilo checkpoint (a run dir, its newest checkpoint; a step dir; or a model dir) as a plain
    transformers directory: LlamaForCausalLM (format "llama") or Mamba2ForCausalLM ("mamba2"; "auto" picks by the
    model's mixer), with the checkpoint's tokenizer. Loads with AutoModelForCausalLM / AutoTokenizer and no hilo
    import. Returns {"out", "format", "architecture", "tokenizer"} (what was written). Raises ConversionError for a
    model that neither architecture represents (gated_deltanet, hybrids, operators, mlp on a mamba2, ...)."""
    from transformers import LlamaForCausalLM, Mamba2ForCausalLM

    model_dir, tok_dir = _hilo_source(src)
    config_dict = json.loads((model_dir / "config.json").read_text())
    if config_dict.get("model_type") != HiloConfig.model_type:
        raise ConversionError(f"{str(model_dir)!r} is not a hilo model (model_type "
                              f"{config_dict.get('model_type')!r}); export takes hilo checkpoints, import takes "
                              f"transformers ones")
    config = HiloConfig.from_pretrained(model_dir)
    fmt = _export_format(config, format)
    to_config, to_state, model_cls = {"llama": (llama_config_from_hilo, hilo_to_llama_state_dict, LlamaForCausalLM),
                                      "mamba2": (mamba2_config_from_hilo, hilo_to_mamba2_state_dict,
                                                 Mamba2ForCausalLM)}[fmt]
    try:
        peer_config = to_config(config)
        state_dict = to_state(config, _read_weights(model_dir))
    except ConversionError as e:
        raise ConversionError(f"cannot export as {model_cls.__name__}: {e}; {EXPORTABLE}") from None
    out = Path(out).expanduser()
    _check_out_dir(out, overwrite)
    note = "none (no tokenizer beside the model)"
    if tok_dir is not None:
        try:
            tok, note = write_hf_tokenizer(tok_dir, out)
        except TokenizerConversionError as e:
            raise ConversionError(f"cannot export the tokenizer: {e}") from None
        peer_config.bos_token_id, peer_config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        peer_config.pad_token_id = tok.pad_token_id
    _save_model(model_cls, peer_config, state_dict, out)
    if fmt == "mamba2":
        # transformers 5 writes the (0, inf) dt limit as {"__float__": "Infinity"}, which transformers 4 (and tools
        # pinned to it) cannot read; (0, inf) is Mamba2Config's default in both, so the key is left out
        config_file = out / "config.json"
        written = json.loads(config_file.read_text())
        if written.get("time_step_limit") == [0.0, {"__float__": "Infinity"}]:
            del written["time_step_limit"]
            config_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return {"out": out, "format": fmt, "architecture": model_cls.__name__, "tokenizer": note}


def import_checkpoint(src: str | Path, out: str | Path, *, overwrite: bool = False, **overrides) -> dict:
    """Write a transformers LlamaForCausalLM or Mamba2ForCausalLM directory as a hilo model directory
    (save_pretrained of HiloForCausalLM: `import models; AutoModelForCausalLM.from_pretrained(out)`), with the
    source's tokenizer files copied beside the weights (so tokenizer=hf with name_or_path=out reads them).
    overrides set hilo implementation options (attn_backend, fused_projections, ...). Returns {"out", "family",
    "tokenizer"}. Raises ConversionError for a model type or an option hilo has no counterpart for."""
    from transformers import AutoConfig

    from models.lm import HiloForCausalLM

    src = Path(src).expanduser()
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{str(src)!r} holds no config.json: pass a transformers model directory (what "
                                f"save_pretrained writes)")
    model_type = json.loads((src / "config.json").read_text()).get("model_type")
    if model_type not in ("llama", "mamba2"):
        hint = " (it is already a hilo model)" if model_type == HiloConfig.model_type else ""
        raise ConversionError(f"cannot import model_type {model_type!r}{hint}: hilo imports transformers' llama "
                              f"(as its transformer) and mamba2 (as mamba2 with mlp=false)")
    peer_config = AutoConfig.from_pretrained(src)
    to_config, to_state = {"llama": (hilo_config_from_llama, llama_to_hilo_state_dict),
                           "mamba2": (hilo_config_from_mamba2, mamba2_to_hilo_state_dict)}[model_type]
    try:
        config = to_config(peer_config, **overrides)
        state_dict = to_state(peer_config, _read_weights(src))
    except ConversionError as e:
        raise ConversionError(f"cannot import {model_type}: {e}") from None
    out = Path(out).expanduser()
    _check_out_dir(out, overwrite)
    _save_model(HiloForCausalLM, config, state_dict, out)
    copied = [name for name in _HF_TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, out / name)
    return {"out": out, "family": "transformer" if model_type == "llama" else "mamba2",
            "tokenizer": f"copied {', '.join(copied)}" if copied else "none (the source has no tokenizer files)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.convert",
        description="Convert checkpoints between hilo and transformers (docs/checkpoints.md). export: a hilo "
                    "transformer or mamba2 (mlp=false) checkpoint -> a LlamaForCausalLM / Mamba2ForCausalLM "
                    "directory with its tokenizer, loadable without hilo (transformers, vLLM, "
                    "lm-evaluation-harness). import: a transformers Llama or Mamba-2 directory -> a hilo model "
                    "directory. Exits with 2 and one line naming what cannot be mapped when the architectures "
                    "differ.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="hilo checkpoint -> transformers directory",
                         description=f"Export a hilo checkpoint as a plain transformers directory. {EXPORTABLE}.")
    exp.add_argument("src", help="a run dir (runs/<name>: its newest checkpoint), a checkpoint dir "
                                 "(runs/<name>/checkpoints/step_XXXXXXXX) or a hilo model dir (its model/)")
    exp.add_argument("out", help="the transformers directory to write (must be empty or new)")
    exp.add_argument("--format", choices=EXPORT_FORMATS, default="auto",
                     help="llama (transformer), mamba2 (mamba2, mlp=false) or auto: picked by the model's mixer "
                          "(default)")
    imp = sub.add_parser("import", help="transformers Llama / Mamba-2 directory -> hilo model directory",
                         description="Import a transformers LlamaForCausalLM or Mamba2ForCausalLM directory as a "
                                     "hilo model directory (load it with `import models; "
                                     "AutoModelForCausalLM.from_pretrained(out)`); its tokenizer files are "
                                     "copied beside the weights.")
    imp.add_argument("src", help="a transformers model directory (config.json model_type llama or mamba2)")
    imp.add_argument("out", help="the hilo model directory to write (must be empty or new)")
    for p in (exp, imp):
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of output per conversion
    try:
        if args.command == "export":
            done = export_checkpoint(args.src, args.out, args.format, overwrite=args.overwrite)
            print(f"wrote {done['out']}: {done['architecture']}; tokenizer: {done['tokenizer']}")
        else:
            done = import_checkpoint(args.src, args.out, overwrite=args.overwrite)
            print(f"wrote {done['out']}: hilo {done['family']}; tokenizer: {done['tokenizer']}")
    except (ConversionError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
