"""Tokenizers: a SentencePiece BPE model (trained on the local corpus once and cached) or any HF tokenizer.

``load_tokenizer(cfg)`` returns an object with ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``eos_id``, ``bos_id``, ``pad_id`` and ``name``. ``sentencepiece_to_hf`` rebuilds a SentencePiece
model as a transformers fast tokenizer with the same ids (what a checkpoint's model directory and an export carry).

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
characters become byte tokens). Ids: 0 unk, 1 bos, 2 eos; the model has no pad piece, so ``pad_id`` is eos.

HF config (conf/tokenizer/hf.yaml): ``{type: hf, name_or_path: gpt2}`` (a hub name or a local directory) through
``transformers.AutoTokenizer``; encode adds no special tokens; ``bos_id`` falls back to ``eos_id`` when the
tokenizer has no BOS token (GPT-2 style), ``pad_id`` to ``eos_id`` when it has no pad token.
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
        self.pad_id = int(self.sp.pad_id()) if self.sp.pad_id() >= 0 else self.eos_id
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
        self.pad_id = int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


class TokenizerConversionError(ValueError):
    """A SentencePiece model that sentencepiece_to_hf cannot rebuild with the same ids."""


def sentencepiece_to_hf(model_file: str | Path):
    """A transformers fast tokenizer (PreTrainedTokenizerFast over a tokenizers BPE) that encodes and decodes as
    hilo's SentencePiece BPE model does (identity normalisation, no dummy prefix, byte fallback, whitespace kept:
    train_sentencepiece): spaces become U+2581 and the merges are ranked by the merged piece's score. The text is
    split into SentencePiece's training words (a run of U+2581 and what follows it), which no piece crosses: the
    ids are the same without the split, which only keeps each BPE word short. Needs no sentencepiece to load.

    No BOS or EOS is added to an encoding (hilo trains on documents each followed by EOS, with no BOS); the model
    has no pad piece, so pad is EOS; padding goes on the left, where generate() needs it for a decoder-only model.
    Raises TokenizerConversionError for a model trained with other settings (unigram, normalisation, dummy prefix),
    which this rebuild would encode differently."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        problems.append(f"model_type {sentencepiece_model_pb2.TrainerSpec.ModelType.Name(trainer.model_type)} "
                        f"(only BPE)")
    if norm.name != "identity" or norm.precompiled_charsmap:
        problems.append(f"normalization {norm.name!r} (only identity)")
    if norm.add_dummy_prefix or not norm.escape_whitespaces or norm.remove_extra_whitespaces:
        problems.append("add_dummy_prefix / remove_extra_whitespaces set or escape_whitespaces unset")
    if trainer.treat_whitespace_as_suffix or not trainer.split_by_whitespace:
        problems.append("treat_whitespace_as_suffix or split_by_whitespace=false")
    if problems:
        raise TokenizerConversionError(f"SentencePiece model {str(model_file)!r} was not trained as hilo trains its "
                                       f"tokenizer (data/tokenizer.py): {'; '.join(problems)} do not map")
    pieces = proto.pieces
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    normal = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    merges = []
    for i, p in enumerate(pieces):
        if p.type != normal:
            continue
        merges += [(p.piece[:k], p.piece[k:], i) for k in range(1, len(p.piece))
                   if p.piece[:k] in vocab and p.piece[k:] in vocab]
    merges.sort(key=lambda m: (-pieces[m[2]].score, m[2], vocab[m[0]]))

    def piece(i: int) -> str | None:
        return pieces[i].piece if 0 <= i < len(pieces) else None

    unk, bos, eos = piece(trainer.unk_id), piece(trainer.bos_id), piece(trainer.eos_id)
    pad = piece(trainer.pad_id) or eos
    tok = Tokenizer(BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=unk, fuse_unk=True,
                        byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\u2581*[^\u2581]+|\u2581+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, bos_token=bos, eos_token=eos,
                                   pad_token=pad, padding_side="left", clean_up_tokenization_spaces=False)


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
