"""Tokenizers: a SentencePiece BPE model (trained on the local corpus once and cached) or any HF tokenizer.

``load_tokenizer(cfg)`` returns an object with ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``eos_id``, ``bos_id`` and ``name``.

SentencePiece config (conf/tokenizer/sentencepiece.yaml)::

    type: sentencepiece
    vocab_size: 8192
    model_path: null              # a trained .model file; null = train on `train_files` once and cache it
    train_files: [data/corpus/train-*.jsonl.zst]   # paths/globs read by data.sources (field `text`)
    max_sentences: 200000         # lines sampled (seeded) from the corpus for training

The trained model is cached as ``$HILO_CACHE/tokenizers/<key>.model`` (``HILO_CACHE`` defaults to
``~/.cache/hilo``) where ``key`` hashes the training files' bytes and every training setting, so a changed
corpus or setting trains a new model and an unchanged one is reused. Training runs under a file lock and the
model is moved into place with an atomic rename, so concurrent processes (several ranks) never see a partial
file. The model is deterministic: a seeded sample of lines, identity normalisation (text round-trips
exactly, whitespace and indentation included) and byte fallback (any string encodes; newlines and rare
characters become byte tokens). Ids: 0 unk, 1 bos, 2 eos.

HF config (conf/tokenizer/hf.yaml): ``{type: hf, name_or_path: gpt2}`` (a hub name or a local directory) through
``transformers.AutoTokenizer``; encode adds no special tokens; ``bos_id`` falls back to ``eos_id`` when the
tokenizer has no BOS token (GPT-2 style).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .sources import expand_paths, iter_file_records

TOKENIZER_TYPES = ("sentencepiece", "hf")
# Bumped when the training recipe below changes, so old cached models are not reused.
_RECIPE_VERSION = 1
_SAMPLE_SEED = 0
DEFAULT_TRAIN_FILES = ("data/corpus/train-*.jsonl.zst",)


def cache_dir() -> Path:
    return Path(os.environ.get("HILO_CACHE", Path.home() / ".cache" / "hilo")).expanduser()


class SentencePieceTokenizer:
    """Wraps a SentencePiece model file."""

    def __init__(self, model_path: str | Path):
        import sentencepiece as spm

        self.model_path = str(model_path)
        self.sp = spm.SentencePieceProcessor(model_file=self.model_path)
        self.vocab_size = int(self.sp.get_piece_size())
        self.eos_id = int(self.sp.eos_id())
        self.bos_id = int(self.sp.bos_id())
        if self.eos_id < 0 or self.bos_id < 0:
            raise ValueError(f"SentencePiece model {self.model_path} defines no eos/bos piece (eos {self.eos_id}, "
                             f"bos {self.bos_id}); train it with eos_id/bos_id set")
        self.name = f"sentencepiece:{Path(self.model_path).name}"

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


class HFTokenizer:
    """Wraps ``transformers.AutoTokenizer.from_pretrained(name_or_path)``."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(name_or_path)
        # Whole documents are encoded and packed later: never truncate, and no "sequence too long" warnings.
        self.tok.model_max_length = 1 << 62
        self.name = str(name_or_path)
        self.vocab_size = len(self.tok)
        eos = self.tok.eos_token_id
        if eos is None:
            raise ValueError(f"HF tokenizer {name_or_path!r} has no eos token; documents are separated by EOS, "
                             f"pick a tokenizer that defines one")
        self.eos_id = int(eos)
        self.bos_id = int(self.tok.bos_token_id) if self.tok.bos_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def _sample_lines(files: list[str], max_sentences: int, seed: int) -> list[str]:
    lines = []
    for path in files:
        for text in iter_file_records(path, "text"):
            if isinstance(text, str):
                lines.extend(line for line in text.split("\n") if line.strip())
    if not lines:
        raise ValueError(f"no text found in tokenizer training files {files}")
    if len(lines) > max_sentences:
        keep = sorted(random.Random(seed).sample(range(len(lines)), max_sentences))
        lines = [lines[i] for i in keep]
    return lines


def _train_settings(cfg: Mapping) -> dict:
    return {"recipe": _RECIPE_VERSION, "vocab_size": int(cfg.get("vocab_size", 8192)),
            "max_sentences": int(cfg.get("max_sentences", 200_000)), "seed": _SAMPLE_SEED}


def train_sentencepiece(files: list[str], out_path: Path, vocab_size: int, max_sentences: int, seed: int) -> None:
    """Train a BPE model on a seeded sample of the lines of ``files`` and write it to ``out_path`` atomically."""
    import sentencepiece as spm

    lines = _sample_lines(files, max_sentences, seed)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_path.parent) as tmp:
        prefix = Path(tmp) / "spm"
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_prefix=str(prefix), model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
            character_coverage=0.9999, max_sentence_length=16384, input_sentence_size=0,
            shuffle_input_sentence=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=1, minloglevel=2)
        # The trainer records its temporary model_prefix in the file; blank it so that the bytes depend only
        # on the corpus and the settings (the same model trained twice is byte-identical).
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(Path(f"{prefix}.model").read_bytes())
        proto.trainer_spec.model_prefix = ""
        tmp_model = Path(tmp) / "final.model"
        tmp_model.write_bytes(proto.SerializeToString())
        os.replace(tmp_model, out_path)


def sentencepiece_model_path(cfg: Mapping) -> Path:
    """Path of the model for ``cfg``: ``model_path`` if given, else the cached model (trained if missing)."""
    if cfg.get("model_path"):
        path = Path(str(cfg["model_path"])).expanduser()
        if not path.is_absolute():
            path = Path(__file__).resolve().parent.parent / path
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model {cfg['model_path']!r} not found (resolved to {path}); "
                                    f"set tokenizer.model_path to an existing .model file, or to null to train "
                                    f"one on the corpus")
        return path
    files = expand_paths(list(cfg.get("train_files") or DEFAULT_TRAIN_FILES))
    settings = _train_settings(cfg)
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for f in files:
        import fsspec

        with fsspec.open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    path = cache_dir() / "tokenizers" / f"spm-bpe{settings['vocab_size']}-{h.hexdigest()[:16]}.model"
    if path.is_file():
        return path
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not path.is_file():  # another process may have trained it while we waited
            train_sentencepiece(files, path, settings["vocab_size"], settings["max_sentences"], settings["seed"])
    return path


def load_tokenizer(cfg: Mapping):
    """Build the tokenizer described by ``cfg`` (see the module docstring)."""
    kind = cfg.get("type", "sentencepiece")
    if kind == "sentencepiece":
        return SentencePieceTokenizer(sentencepiece_model_path(cfg))
    if kind == "hf":
        name = cfg.get("name_or_path")
        if not name:
            raise ValueError("tokenizer type 'hf' needs `name_or_path` (a hub name such as 'gpt2' or a local dir)")
        if str(name).startswith(("/", ".", "~")) and not Path(str(name)).expanduser().exists():
            raise FileNotFoundError(f"HF tokenizer directory {name!r} does not exist; set tokenizer.name_or_path "
                                    f"to a saved tokenizer directory or a hub name")
        return HFTokenizer(str(Path(str(name)).expanduser()) if str(name).startswith("~") else str(name))
    raise ValueError(f"unknown tokenizer type {kind!r}; valid types: {', '.join(TOKENIZER_TYPES)}")
