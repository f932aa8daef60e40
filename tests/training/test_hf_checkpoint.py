"""A checkpoint's model/ directory loads anywhere transformers does (docs/checkpoints.md), CPU.

A two-step training run writes a real checkpoint; its model/ must hold the weights (and accelerate/ none), the
tokenizer as transformers files with bos / eos / pad, and the remote code. Fresh processes (`python -I`, the venv's
editable hilo finder removed, nothing of hilo imported beforehand) load it with AutoModelForCausalLM(...,
trust_remote_code=True) + AutoTokenizer and must give the logits and token ids of hilo's own loading, and run
pipeline("text-generation") on a batch of two prompts as generate() runs each alone; with hilo's packages on the
path, as an installed hilo is (the saved code imports them: the kernels are hilo's), for every family; without them,
the load stops with an ImportError saying to install hilo.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
from hilo_kernels.common import error_ratio
from models.config import AUTO_MAP
from tests.training.helpers import run_train, small_cfg
from training.checkpoint import CheckpointError, load_checkpoint_model, load_checkpoint_tokenizer, load_model_weights

REPO = Path(__file__).resolve().parents[2]
FAMILIES = {  # tiny members of each family (conf/model/*.yaml), saved as the checkpoint writer saves model/
    "mamba2": {"mixer": "mamba2", "mlp": False, "mixer_kwargs": {"head_dim": 8, "state_size": 8}},
    "gated_deltanet": {"mixer": "gated_deltanet", "mixer_kwargs": {"head_dim": 16}},
    "hla_transformer": {"mixer": "attention", "operator": "hla2"},
    "loglinear_mamba2": {"mixer": "loglinear_mamba2", "mlp": False, "mixer_kwargs": {"head_dim": 8, "state_size": 8}},
    "loglinear_gated_deltanet": {"mixer": "loglinear_gated_deltanet", "mixer_kwargs": {"head_dim": 16}},
}
TINY = {"vocab_size": 97, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2}

# `python -I` drops PYTHONPATH, the working directory and user site; the venv's editable finder (which would import
# /work/main-style installs of hilo) is removed too, so hilo is importable only where the script puts it.
SCRIPT = r"""
import json, sys
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
job = json.load(open(sys.argv[1]))
if job["hilo_path"]:
    sys.path.insert(0, job["hilo_path"])  # where an installed hilo's packages are
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
result = {"hilo_before": sorted({m.split(".")[0] for m in sys.modules} & {"models", "hilo_kernels"})}
try:
    AutoModelForCausalLM.from_pretrained(job["dirs"][0])
except Exception as e:  # without trust_remote_code: transformers says how
    result["without_remote_code"] = f"{type(e).__name__}: {e}"
try:
    for i, d in enumerate(job["dirs"]):
        model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.save(model(torch.tensor(job["ids"])).logits, f"{job['work']}/logits{i}.pt")
        result.setdefault("classes", []).append(f"{type(model).__module__}.{type(model).__name__}")
    model.save_pretrained(f"{job['work']}/resaved")  # a model loaded as remote code, saved again
except ImportError as e:
    result["import_error"] = str(e)
else:
    import hilo_kernels, models
    result["module_files"] = [models.__file__, hilo_kernels.__file__]
    hub = sys.modules.get("kernels")  # Hugging Face's kernels, when transformers has imported it
    result["hub_kernels"] = None if hub is None else [hasattr(hub, "get_kernel"), hub.__file__]
if job["texts"]:
    tok = AutoTokenizer.from_pretrained(job["dirs"][0])
    result["special"] = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.padding_side]
    result["ids"] = [tok(t).input_ids for t in job["texts"]]
    pipe = pipeline("text-generation", model=job["dirs"][0], trust_remote_code=True)
    out = pipe(job["prompts"], batch_size=2, max_new_tokens=5, do_sample=False, return_full_text=False)
    result["generated"] = [o[0]["generated_text"] for o in out]
json.dump(result, open(f"{job['work']}/result.json", "w"))
"""


def run_fresh(work: Path, dirs: list[Path], hilo_path: Path | None, ids, texts=(), prompts=()) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    job = {"dirs": [str(d) for d in dirs], "hilo_path": str(hilo_path) if hilo_path else None, "ids": ids.tolist(),
           "texts": list(texts), "prompts": list(prompts), "work": str(work)}
    (work / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(work / "hf_modules")  # where transformers copies the remote code
    proc = subprocess.run([sys.executable, "-I", "-c", SCRIPT, str(work / "job.json")], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((work / "result.json").read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hf") / "run"
    run_train(small_cfg("trainer.max_steps=2", "trainer.save_every=2", "trainer.val_every=0",
                        "trainer.final_eval=false"), run_dir)
    return run_dir / "checkpoints" / "step_00000002"


def test_model_dir_holds_weights_tokenizer_and_remote_code(checkpoint):
    model_dir = checkpoint / "model"
    assert sorted(p.name for p in checkpoint.rglob("*.safetensors")) == ["model.safetensors"]  # stored once
    assert not list((checkpoint / "accelerate").glob("model*"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modeling_hilo.py"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_hilo.HiloForCausalLM"
    tok = load_checkpoint_tokenizer(checkpoint)
    assert [config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]] == [tok.bos_id, tok.eos_id,
                                                                                         tok.eos_id]
    special = json.loads((model_dir / "special_tokens_map.json").read_text())
    assert special["pad_token"] == special["eos_token"]


TEXTS = ["Hello,  world!\n\tindented 12345", "héllo wörld 🙂", "   leading spaces"]
# padded batches are another matter (attention_mask): two prompts of the same token length need no padding
PROMPTS = ["The cat sat on the mat", "The dog sat on the mat"]


@pytest.fixture(scope="module")
def fresh(checkpoint, tmp_path_factory):
    """One fresh process, hilo installed, loads the checkpoint's model/ (with its tokenizer and a pipeline) and a
    saved model of every family; (its result, its work dir, hilo's logits of each directory on the same ids)."""
    root = tmp_path_factory.mktemp("fresh")
    ids = torch.randint(0, TINY["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))
    dirs, expected = [checkpoint / "model"], [load_checkpoint_model(checkpoint).eval()]
    for name, overrides in FAMILIES.items():
        torch.manual_seed(0)
        expected.append(models.build_model({**TINY, **overrides}).eval())
        expected[-1].save_pretrained(root / name)
        dirs.append(root / name)
    with torch.no_grad():
        logits = [model(ids).logits for model in expected]
    result = run_fresh(root / "work", dirs, REPO, ids, TEXTS, PROMPTS)
    return result, root / "work", logits


def test_checkpoint_loads_with_transformers_alone(checkpoint, fresh):
    """trust_remote_code with hilo installed: hilo's logits and ids, and a batched pipeline() as generate()."""
    result, work, logits = fresh
    assert result["hilo_before"] == [] and result["classes"][0] == "models.lm.HiloForCausalLM"
    assert [Path(f).parent.parent for f in result["module_files"]] == [REPO, REPO]
    # transformers' own `kernels` dependency, when it imports one, is Hugging Face's, not a module of hilo's
    assert result["hub_kernels"] is None or result["hub_kernels"][0], result["hub_kernels"]
    assert "trust_remote_code=True" in result["without_remote_code"]
    assert error_ratio(torch.load(work / "logits0.pt"), logits[0]) <= 1e-6
    tok = load_checkpoint_tokenizer(checkpoint)
    assert result["ids"] == [tok.encode(t) for t in TEXTS]
    assert result["special"] == [tok.bos_id, tok.eos_id, tok.eos_id, "left"]
    assert len(tok.encode(PROMPTS[0])) == len(tok.encode(PROMPTS[1]))
    model = load_checkpoint_model(checkpoint).eval()
    for prompt, generated in zip(PROMPTS, result["generated"], strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([tok.encode(prompt)]), max_new_tokens=5, do_sample=False)
        assert generated == tok.decode(out[0, len(tok.encode(prompt)):].tolist())


def test_every_family_loads_through_remote_code(fresh):
    result, work, logits = fresh
    assert result["classes"] == ["models.lm.HiloForCausalLM"] * (1 + len(FAMILIES))
    for i, name in enumerate(FAMILIES, start=1):
        assert error_ratio(torch.load(work / f"logits{i}.pt"), logits[i]) <= 1e-6, name
    # saved again after a remote-code load: the same remote code and auto_map, not a copy of hilo's modules
    resaved = work / "resaved"
    assert sorted(p.name for p in resaved.glob("*.py")) == ["modeling_hilo.py"]
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == AUTO_MAP


def test_without_hilo_the_remote_code_says_what_to_install(tmp_path):
    torch.manual_seed(0)
    models.build_model(TINY).save_pretrained(tmp_path / "model")
    result = run_fresh(tmp_path / "work", [tmp_path / "model"], None, torch.zeros(1, 3, dtype=torch.long))
    assert "Install hilo in this environment" in result["import_error"]
    assert "python -m training.convert export" in result["import_error"]


@pytest.mark.parametrize("tied", [False, True])
def test_load_model_weights_restores_every_tensor(tied, tmp_path):
    torch.manual_seed(0)
    saved = models.build_model({**TINY, "tie_word_embeddings": tied})
    saved.save_pretrained(tmp_path / "model")
    torch.manual_seed(1)
    model = models.build_model({**TINY, "tie_word_embeddings": tied})
    load_model_weights(model, tmp_path)
    a, b = saved.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(CheckpointError, match="weights of another model"):
        load_model_weights(models.build_model({**TINY, "num_layers": 3, "tie_word_embeddings": tied}), tmp_path)
