"""The shipped data/tokenizer configs compose into working loaders (the remote ones up to the network)."""

import fsspec
import pytest
import torch
from omegaconf import OmegaConf

from data import build_train_loader, iter_heldout_documents, load_tokenizer
from data.sources import REPO_ROOT, file_format

CONF = REPO_ROOT / "conf"


def load(group, name):
    return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"), resolve=True)


@pytest.mark.parametrize("packing", ["fixed", "varlen"])
def test_default_data_config_trains_from_any_working_directory(tmp_path, monkeypatch, packing):
    monkeypatch.chdir(tmp_path)  # Hydra-style: relative paths must still resolve against the repo
    tok = load_tokenizer(load("tokenizer", "sentencepiece"))
    cfg = {**load("data", "default"), "packing": packing}
    loader = build_train_loader(cfg, tok, seq_len=256, batch_size=2, rank=1, world_size=2, seed=0)
    batch = next(loader)
    assert batch["input_ids"].numel() == 512 and int(batch["input_ids"].max()) < tok.vocab_size
    assert (batch["input_ids"] == tok.eos_id).any() or loader.stats["docs"] == 1
    assert "Python" in tok.decode(torch.cat([next(loader)["input_ids"].flatten() for _ in range(20)]).tolist())
    doc = next(iter_heldout_documents(cfg, tok, min_tokens=4096, max_docs=1))
    assert len(doc) >= 4096


def test_long_data_collections_config():
    cfg = load("data", "long_data_collections")
    paths = [p for s in cfg["sources"] for p in s["paths"]]
    assert len(paths) == 6 and not any("book.jsonl.zst" in p for p in paths)  # deleted upstream
    assert all(s["type"] == "files" and s["field"] == "text" and s["weight"] > 0 for s in cfg["sources"])
    for p in paths:
        assert p.startswith("hf://datasets/togethercomputer/Long-Data-Collections/pretrain/")
        fs, _ = fsspec.core.url_to_fs(p)  # the same reader, through huggingface_hub's filesystem
        assert type(fs).__name__ == "HfFileSystem" and file_format(p) == "jsonl.zst"
    assert (REPO_ROOT / cfg["heldout"]).is_file()


@pytest.mark.parametrize("name", ["default", "hub", "long_data_collections"])
def test_retrieval_mix_is_off_in_the_shipped_data_configs(name):
    mix = load("data", name)["retrieval_mix"]
    assert mix["fraction"] == 0.0 and mix["tasks"] == ["niah_single_1", "niah_single_2", "niah_single_3",
                                                       "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
                                                       "niah_multivalue", "niah_multiquery"]


def test_hub_and_hf_tokenizer_configs():
    hub = load("data", "hub")
    (source,) = hub["sources"]
    assert source["type"] == "hub" and {"name", "config", "split", "field"} <= set(source)
    assert load("tokenizer", "hf")["type"] == "hf" and load("tokenizer", "hf")["name_or_path"]
