"""eval refuses a checkpoint whose saved weights do not match its model (missing or unexpected tensors)."""
import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import models
from training import evaluation
from training.evaluation import evaluate_checkpoint

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
        "mixer": "mamba2", "mixer_kwargs": {"head_dim": 32, "state_size": 16}}
DROPPED = "model.layers.1.mixer.D"
EXTRA = "model.layers.7.mixer.extra"


class ModTokenizer:
    bos_id, eos_id, vocab_size, name = 0, 1, 128, "mod"

    def encode(self, text):
        return [2 + b % 126 for b in text.encode()]


def make_checkpoint(tmp_path, edit=None, **config):
    torch.manual_seed(0)
    model = models.build_model({**TINY, **config})
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    model.save_pretrained(ckpt / "model")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": "abcdefghij" * 8}) + "\n" for _ in range(2)))
    OmegaConf.save(OmegaConf.create({"name": "tiny", "trainer": {"seq_len": 16},
                                     "data": {"heldout": str(heldout)}}), ckpt / "config.yaml")
    if edit is not None:
        weights = ckpt / "model" / "model.safetensors"
        tensors = load_file(str(weights))
        edit(tensors)
        save_file(tensors, str(weights), metadata={"format": "pt"})
    return ckpt, model


def drop(tensors):
    del tensors[DROPPED]


def add(tensors):
    tensors[EXTRA] = torch.zeros(3)


def test_intact_checkpoint_loads_with_every_weight(tmp_path):
    from training.evaluation import load_model_checked

    ckpt, model = make_checkpoint(tmp_path)
    loaded = load_model_checked(ckpt)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_tied_embeddings_are_not_missing(tmp_path):
    from training.evaluation import load_model_checked

    ckpt, _ = make_checkpoint(tmp_path, tie_word_embeddings=True)
    load_model_checked(ckpt)


@pytest.mark.parametrize("edit,key,kind", [(drop, DROPPED, "missing"), (add, EXTRA, "unexpected")])
def test_missing_or_unexpected_weights_are_refused(tmp_path, edit, key, kind):
    from training.evaluation import PartialWeightsError, load_model_checked

    ckpt, _ = make_checkpoint(tmp_path, edit=edit)
    with pytest.raises(PartialWeightsError, match=rf"(?s){kind} \(1\): {key}.*eval.allow_partial_weights=true"):
        load_model_checked(ckpt)


def test_evaluate_checkpoint_refuses_and_scores_only_when_allowed(tmp_path, monkeypatch):
    ckpt, _ = make_checkpoint(tmp_path, edit=drop)
    monkeypatch.setattr(evaluation, "load_checkpoint_tokenizer", lambda path: ModTokenizer())
    eval_cfg = OmegaConf.create({"suite": "ppl_by_position", "seq_len": 16, "num_documents": 2, "batch_size": 2,
                                 "smooth_window": None, "out_dir": str(tmp_path / "out"),
                                 "allow_partial_weights": False})
    with pytest.raises(ValueError, match=DROPPED):  # PartialWeightsError
        evaluate_checkpoint(ckpt, eval_cfg, device=torch.device("cpu"))
    assert not (tmp_path / "out").exists()  # nothing was scored
    eval_cfg.allow_partial_weights = True
    with pytest.warns(UserWarning, match="EVALUATING ANYWAY"):
        result = evaluate_checkpoint(ckpt, eval_cfg, device=torch.device("cpu"))
    assert result["num_documents"] == 2 and (tmp_path / "out").exists()
