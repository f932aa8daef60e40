from pathlib import Path

import pytest

import data.tokenizer as tokmod
from data import iter_heldout_documents, load_tokenizer
from data.sources import iter_file_records
from tests.data.helpers import jsonl_lines, write_jsonl

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
        "    def indented(self, x):\n        return x * 2  # code\n")


def small_corpus(tmp_path):
    docs = [TEXT * (1 + i % 3) + f"document number {i}" for i in range(60)]
    return [str(write_jsonl(tmp_path / "train.jsonl", jsonl_lines(docs)))]


def small_cfg(tmp_path, **kw):
    return {"type": "sentencepiece", "vocab_size": 400, "model_path": None, "train_files": small_corpus(tmp_path),
            **kw}


def test_sentencepiece_roundtrip_and_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("HILO_CACHE", str(tmp_path / "cache"))
    tok = load_tokenizer(small_cfg(tmp_path))
    assert tok.vocab_size == 400 and (tok.bos_id, tok.eos_id) == (1, 2)
    for text in (TEXT, "  leading and trailing spaces  ", "tabs\tand\r\nCRLF", "unseen: ✓ 日本語 ñ 🙂", ""):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode(TEXT)) < len(TEXT.encode()) / 2  # it learned merges, not just bytes


def test_sentencepiece_is_cached_and_keyed(tmp_path, monkeypatch):
    monkeypatch.setenv("HILO_CACHE", str(tmp_path / "cache"))
    cfg = small_cfg(tmp_path)
    first = load_tokenizer(cfg)
    models = list((tmp_path / "cache" / "tokenizers").glob("*.model"))
    assert len(models) == 1 and first.model_path == str(models[0])

    def must_not_train(*a, **k):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tokmod, "train_sentencepiece", must_not_train)
    assert load_tokenizer(cfg).encode(TEXT) == first.encode(TEXT)
    monkeypatch.undo()
    monkeypatch.setenv("HILO_CACHE", str(tmp_path / "cache"))
    load_tokenizer({**cfg, "vocab_size": 420})  # another setting -> another model
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.model"))) == 2
    # retraining from scratch elsewhere gives a byte-identical model (deterministic training)
    monkeypatch.setenv("HILO_CACHE", str(tmp_path / "cache2"))
    again = load_tokenizer(cfg)
    assert Path(again.model_path).read_bytes() == Path(first.model_path).read_bytes()
    assert load_tokenizer({"type": "sentencepiece", "model_path": first.model_path}).encode(TEXT) == first.encode(TEXT)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer type 'bpe'.*sentencepiece, hf"):
        load_tokenizer({"type": "bpe"})
    with pytest.raises(FileNotFoundError, match="nothing.model"):
        load_tokenizer({"type": "sentencepiece", "model_path": str(tmp_path / "nothing.model")})
    with pytest.raises(ValueError, match="name_or_path"):
        load_tokenizer({"type": "hf"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer({"type": "hf", "name_or_path": str(tmp_path / "no_tokenizer_dir")})


def test_hf_tokenizer_from_local_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(["hello", "world", "!"])}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)
    tok = load_tokenizer({"type": "hf", "name_or_path": str(tmp_path)})
    assert tok.encode("hello world !") == [3, 4, 5]
    assert tok.eos_id == 1 and tok.bos_id == 1  # no BOS token: falls back to EOS
    assert tok.vocab_size == 6 and tok.decode([3, 4]).split() == ["hello", "world"]


def test_default_tokenizer_on_the_embedded_corpus():
    """The real default (8192 BPE on the Python docs): trained once per cache, lossless, ~3.5 chars/token."""
    tok = load_tokenizer({"type": "sentencepiece", "vocab_size": 8192, "model_path": None})
    assert tok.vocab_size == 8192
    texts = [t for t in iter_file_records(str(tokmod.Path(tokmod.__file__).parent / "corpus" / "heldout.jsonl.zst"))]
    sample = "".join(texts[-5:])
    ids = tok.encode(sample)
    assert tok.decode(ids) == sample
    assert 3.0 < len(sample) / len(ids) < 5.0
    long_docs = list(iter_heldout_documents({"heldout": "data/corpus/heldout.jsonl.zst"}, tok, 8192, None))
    assert len(long_docs) >= 20 and max(map(len, long_docs)) > 32768


def test_concurrent_processes_share_one_trained_model(tmp_path):
    """Several ranks loading at once: the file lock makes one train and the others reuse the finished file."""
    import os
    import subprocess
    import sys

    from data.sources import REPO_ROOT

    files = small_corpus(tmp_path)
    script = ("import sys, hashlib; from data import load_tokenizer; "
              f"t = load_tokenizer({{'type': 'sentencepiece', 'vocab_size': 400, 'train_files': {files!r}}}); "
              "print(hashlib.sha256(open(t.model_path, 'rb').read()).hexdigest())")
    env = {**os.environ, "HILO_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    digests = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(digests) == 1
    assert [p.name for p in (tmp_path / "cache" / "tokenizers").iterdir() if not p.name.endswith(".lock")] == [
        next(iter((tmp_path / "cache" / "tokenizers").glob("*.model"))).name]
