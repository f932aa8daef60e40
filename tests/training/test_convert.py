"""python -m training.convert: whole checkpoint directories between hilo and transformers (docs/checkpoints.md), CPU.

Export: a tiny hilo transformer and mamba2 (mlp=false), saved in the checkpoint layout with hilo's default
SentencePiece tokenizer, are exported; a fresh Python process that cannot import hilo (its packages are blocked)
loads the directory with AutoModelForCausalLM / AutoTokenizer and must give hilo's logits (error ratio <= 1e-5) on
the same tokens and hilo's token ids on the same texts. Import: a random LlamaForCausalLM / Mamba2ForCausalLM
directory is imported and hilo's logits must equal the peer's. Errors: a gated_deltanet model and a hybrid exit with
2 and one line naming what cannot be mapped.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Mamba2ForCausalLM

from data import load_tokenizer
from data.sources import iter_file_records
from data.tokenizer import TokenizerConversionError, sentencepiece_to_hf
from hilo_kernels.common import error_ratio
from models import HiloConfig, HiloForCausalLM
from tests.models.test_parity import randomize_
from training import convert
from training.checkpoint import _save_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5
VOCAB = 8192  # the default SentencePiece tokenizer's
TRANSFORMER = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 3, "num_kv_heads": 1,
               "head_dim": 16, "intermediate_size": 72, "rope_theta": 500.0, "mixer": "attention"}
MAMBA2 = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "mixer": "mamba2", "mlp": False,
          "mixer_kwargs": {"head_dim": 12, "state_size": 10, "expand": 2, "n_groups": 2, "conv_size": 4}}
TEXTS = ["Hello,  world!\n\tindented 12345 x\n\n  trailing  ", "héllo wörld 🙂 ∑ 中文", "   leading spaces",
         "def f(x):\n    return x ** 2  # comment\n"]

# Runs with `python -I` (no PYTHONPATH, no working directory on sys.path) and without the finder of the venv's
# editable hilo install: hilo's packages cannot be found, as for a transformers / vLLM / lm-eval user.
PEER_SCRIPT = r"""
import importlib.util, json, sys
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
HILO = ("models", "hilo_kernels", "data", "training", "eval_suites")
assert all(importlib.util.find_spec(name) is None for name in HILO), [importlib.util.find_spec(n) for n in HILO]
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, work = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(out).eval()
tok = AutoTokenizer.from_pretrained(out)
with torch.no_grad():
    logits = model(torch.load(f"{work}/ids.pt")).logits
torch.save(logits, f"{work}/peer_logits.pt")
texts = json.load(open(f"{work}/texts.json"))
ids = [tok(t).input_ids for t in texts]
json.dump({"class": type(model).__name__, "ids": ids, "decoded": [tok.decode(i) for i in ids],
           "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
           "config_special": [model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id],
           "hilo_modules": sorted({m.split(".")[0] for m in sys.modules} & set(HILO))}, open(f"{work}/peer.json", "w"))
"""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer({"type": "sentencepiece", "vocab_size": VOCAB})  # trained once per cache


def make_checkpoint(run_dir: Path, config: HiloConfig, tokenizer, seed: int = 1) -> HiloForCausalLM:
    """What training.checkpoint writes that export reads: runs/<name>/checkpoints/step_X/{model,tokenizer}/, the
    trainer state marking the checkpoint complete, and `latest`."""
    torch.manual_seed(0)
    model = HiloForCausalLM(config).eval()
    randomize_(model, seed=seed)
    step = run_dir / "checkpoints" / "step_00000010"
    model.save_pretrained(step / "model")
    _save_tokenizer(tokenizer, step / "tokenizer")
    (step / "trainer_state.json").write_text(json.dumps({"step": 10}))
    (run_dir / "checkpoints" / "latest").write_text(step.name)
    return model


def run_peer(out: Path, work: Path, model: HiloForCausalLM, tokenizer) -> dict:
    """Load out in a fresh process with no hilo on its path; its logits' error ratio against hilo's and its
    token ids for TEXTS (hilo's tokenizer's ids are the expected ones)."""
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(3))
    torch.save(ids, work / "ids.pt")
    texts = TEXTS + ["".join(next(iter(iter_file_records(str(REPO / "data/corpus/heldout.jsonl.zst"), "text")))[:4000])]
    (work / "texts.json").write_text(json.dumps(texts))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-c", PEER_SCRIPT, str(out), str(work)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peer = json.loads((work / "peer.json").read_text())
    with torch.no_grad():
        ref = model(ids).logits
    peer["error_ratio"] = error_ratio(torch.load(work / "peer_logits.pt"), ref)
    peer["expected_ids"] = [tokenizer.encode(t) for t in texts]
    peer["texts"] = texts
    return peer


def check_peer(peer: dict, architecture: str, tokenizer) -> None:
    assert peer["class"] == architecture and peer["hilo_modules"] == []
    assert peer["error_ratio"] <= TOL, peer["error_ratio"]
    assert peer["ids"] == peer["expected_ids"]  # no BOS/EOS added: hilo trains on documents + EOS, no BOS
    assert peer["decoded"] == peer["texts"]
    special = [tokenizer.bos_id, tokenizer.eos_id, tokenizer.eos_id]  # no pad piece: pad is EOS
    assert peer["special"] == special and peer["config_special"] == special


def test_export_transformer_loads_without_hilo(tokenizer, tmp_path):
    """The CLI on a run dir: LlamaForCausalLM + tokenizer.json, loaded and run by plain transformers."""
    model = make_checkpoint(tmp_path / "run", HiloConfig(**TRANSFORMER), tokenizer)
    out = tmp_path / "llama"
    proc = subprocess.run([sys.executable, "-m", "training.convert", "export", str(tmp_path / "run"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LlamaForCausalLM" in proc.stdout and "pad = eos" in proc.stdout
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    check_peer(run_peer(out, tmp_path, model, tokenizer), "LlamaForCausalLM", tokenizer)


def test_export_mamba2_loads_without_hilo(tokenizer, tmp_path):
    """The Python API on a model dir (its tokenizer found beside it): Mamba2ForCausalLM, tied embeddings."""
    model = make_checkpoint(tmp_path / "run", HiloConfig(**MAMBA2, tie_word_embeddings=True), tokenizer, seed=4)
    step = tmp_path / "run" / "checkpoints" / "step_00000010"
    done = convert.export_checkpoint(step / "model", tmp_path / "mamba2")
    assert done["format"] == "mamba2" and done["architecture"] == "Mamba2ForCausalLM"
    config = json.loads((tmp_path / "mamba2" / "config.json").read_text())
    assert config["model_type"] == "mamba2" and config["tie_word_embeddings"] is True
    assert "time_step_limit" not in config  # Mamba2Config's default (0, inf), written in no version-specific form
    check_peer(run_peer(tmp_path / "mamba2", tmp_path, model, tokenizer), "Mamba2ForCausalLM", tokenizer)


def test_sources_resolve_to_the_newest_checkpoint(tokenizer, tmp_path):
    """A run dir, its step dir and the step's model dir name the same model and tokenizer; --format must fit."""
    make_checkpoint(tmp_path / "run", HiloConfig(**MAMBA2), tokenizer)
    step = tmp_path / "run" / "checkpoints" / "step_00000010"
    expected = (step / "model", step / "tokenizer")
    assert convert._hilo_source(tmp_path / "run") == convert._hilo_source(step) == expected
    assert convert._hilo_source(step / "model") == expected
    with pytest.raises(convert.ConversionError, match="LlamaForCausalLM maps hilo mixer 'attention', got mixer"):
        convert.export_checkpoint(step, tmp_path / "out", format="llama")
    assert not (tmp_path / "out").exists()  # nothing is written before the model is known to map
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        convert.export_checkpoint(tmp_path, tmp_path / "out")


def test_sentencepiece_tokenizer_encodes_as_hilo(tokenizer):
    """The exported tokenizer gives hilo's SentencePiece ids (and text back) on held-out documents."""
    hf = sentencepiece_to_hf(tokenizer.model_path)
    docs = list(iter_file_records(str(REPO / "data/corpus/heldout.jsonl.zst"), "text"))[:6] + TEXTS
    for doc in docs:
        ids = tokenizer.encode(doc)
        assert hf(doc).input_ids == ids
        assert hf.decode(ids) == doc


@pytest.mark.parametrize("tied", [False, True])
def test_import_llama(tied, tmp_path):
    """A transformers LlamaForCausalLM directory -> a hilo model dir with the same logits; tokenizer files copied."""
    peer_config = convert.llama_config_from_hilo(HiloConfig(**dict(TRANSFORMER, vocab_size=97),
                                                            tie_word_embeddings=tied))
    torch.manual_seed(0)
    peer = LlamaForCausalLM(peer_config).eval()
    randomize_(peer, seed=5)
    peer.save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer.json").write_text("{}")  # the files are copied, not parsed
    done = convert.import_checkpoint(tmp_path / "llama", tmp_path / "hilo")
    assert done["family"] == "transformer" and "tokenizer.json" in done["tokenizer"]
    assert (tmp_path / "hilo" / "tokenizer.json").is_file()
    hilo = AutoModelForCausalLM.from_pretrained(tmp_path / "hilo").eval()
    assert isinstance(hilo, HiloForCausalLM) and hilo.config.mixer == "attention"
    assert hilo.config.tie_word_embeddings is tied
    ids = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert error_ratio(hilo(ids).logits, peer(ids).logits) <= TOL


def test_import_mamba2(tmp_path):
    peer_config = convert.mamba2_config_from_hilo(HiloConfig(**dict(MAMBA2, vocab_size=97)))
    torch.manual_seed(0)
    peer = Mamba2ForCausalLM(peer_config).eval()
    randomize_(peer, seed=7)
    peer.save_pretrained(tmp_path / "m2")
    assert convert.main(["import", str(tmp_path / "m2"), str(tmp_path / "hilo")]) == 0
    hilo = AutoModelForCausalLM.from_pretrained(tmp_path / "hilo").eval()
    assert hilo.config.mixer == "mamba2" and hilo.config.mlp is False
    ids = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert error_ratio(hilo(ids).logits, peer(ids).logits) <= TOL
    # a second import into the same (now non-empty) directory is refused unless --overwrite
    assert convert.main(["import", str(tmp_path / "m2"), str(tmp_path / "hilo")]) == 2
    assert convert.main(["import", str(tmp_path / "m2"), str(tmp_path / "hilo"), "--overwrite"]) == 0


TINY = {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 2}


@pytest.mark.parametrize("config, message", [
    ({**TINY, "mixer": "gated_deltanet"},
     "cannot export a model with mixer=gated_deltanet: hilo exports two families"),
    ({**TINY, "mixer": "attention", "operator": "hla2"},
     "cannot export a model with mixer=attention operator=hla2: hilo exports two families"),
    ({**TINY, "mixer": "mamba2", "mlp": False, "attn_layers": [1]},
     "cannot export as Mamba2ForCausalLM: Mamba2ForCausalLM has no hybrid layers: attn_layers [1]"),
    ({**TINY, "mixer": "mamba2"},  # mlp=true
     "cannot export as Mamba2ForCausalLM: Mamba2ForCausalLM blocks have no MLP: needs mlp=false"),
], ids=["gated_deltanet", "hla2", "hybrid", "mamba2_with_mlp"])
def test_export_refuses_what_does_not_map(config, message, tokenizer, tmp_path, capsys):
    make_checkpoint(tmp_path / "run", HiloConfig(**config), tokenizer)
    capsys.readouterr()  # save_pretrained's progress bar
    assert convert.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert "LlamaForCausalLM" in err and "Mamba2ForCausalLM" in err  # which families export
    assert not (tmp_path / "out").exists()


def test_import_refuses_other_model_types(tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert convert.main(["import", str(tmp_path / "gpt2"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("error: cannot import model_type 'gpt2': hilo imports transformers' llama (as "
                                       "its transformer) and mamba2 (as mamba2 with mlp=false)\n")


def test_export_hf_tokenizer_gets_eos_as_pad(tmp_path):
    """A checkpoint trained with tokenizer=hf: its tokenizer files are copied, pad set to eos where it had none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<unk>", "hello", "world", "!"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "hf_tok")
    hf = load_tokenizer({"type": "hf", "name_or_path": str(tmp_path / "hf_tok")})
    make_checkpoint(tmp_path / "run", HiloConfig(**dict(TRANSFORMER, vocab_size=len(words))), hf)
    done = convert.export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert "copied" in done["tokenizer"] and "pad = eos" in done["tokenizer"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("hello world !").input_ids == [3, 4, 5]
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id] == [0, 1, 1]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert [config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]] == [0, 1, 1]


@pytest.mark.parametrize("setting", ["add_dummy_prefix", "remove_extra_whitespaces"])
def test_sentencepiece_trained_otherwise_is_refused(setting, tokenizer, tmp_path):
    """A SentencePiece model whose normalisation the export does not reproduce is refused, not mis-exported."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer.model_path).read_bytes())
    setattr(proto.normalizer_spec, setting, True)
    (tmp_path / "other.model").write_bytes(proto.SerializeToString())
    with pytest.raises(TokenizerConversionError, match="was not trained as hilo trains its tokenizer"):
        sentencepiece_to_hf(tmp_path / "other.model")


def test_export_hf_tokenizer_with_pad_is_copied_unchanged(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", "hello"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(tmp_path / "hf_tok")
    hf = load_tokenizer({"type": "hf", "name_or_path": str(tmp_path / "hf_tok")})
    make_checkpoint(tmp_path / "run", HiloConfig(**dict(TRANSFORMER, vocab_size=len(words))), hf)
    done = convert.export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert done["tokenizer"] == "transformers tokenizer files, copied"
    saved = tmp_path / "run" / "checkpoints" / "step_00000010" / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (saved / name).read_bytes()
    assert not (tmp_path / "out" / "hilo_tokenizer.json").exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["pad_token_id"] == 0
