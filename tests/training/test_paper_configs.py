"""The papers' experiments (conf/experiment/loglinear_paper/): every experiment config composes, the paper grid has
the recipe it documents, its models have the expected size (built on the meta device, no weights), and a shrunken
paper run ends with its several final evaluations (trainer.final_evals)."""
import json
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.training.helpers import CONF, run_train, small_cfg
from training import ConfigError, validate_train_config
from training.evaluation import final_eval_configs

EXPERIMENTS = sorted(str(p.relative_to(CONF / "experiment").with_suffix(""))
                     for p in (CONF / "experiment").rglob("*.yaml") if not p.name.startswith("_"))

# experiment -> (model preset, layers)
PAPER = {
    "transformer_21l": ("transformer", 21),
    "transformer_24l": ("transformer", 24),
    "mamba2": ("mamba2", 21),
    "loglinear_mamba2": ("loglinear_mamba2", 21),
    "gated_deltanet": ("gated_deltanet", 21),
    "loglinear_gated_deltanet": ("loglinear_gated_deltanet", 21),
    "hla_transformer": ("hla_transformer", 21),
    "hla_mamba2": ("hla_mamba2", 21),
    "hla_gated_deltanet": ("hla_gated_deltanet", 21),
}
GPUS = 8
VOCAB = 8192  # the default tokenizer's (conf/tokenizer/sentencepiece.yaml)


class _Tokenizer:  # what training.config.model_kwargs reads of a tokenizer
    eos_id = bos_id = pad_id = 1


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _build_on_meta(cfg):
    import models
    from training.config import model_kwargs

    with torch.device("meta"):
        return models.build_model(model_kwargs(cfg.model, VOCAB, _Tokenizer()))


def test_the_paper_grid_is_all_there():
    assert {e for e in EXPERIMENTS if e.startswith("loglinear_paper/")} == {f"loglinear_paper/{n}" for n in PAPER}
    assert len(EXPERIMENTS) >= len(PAPER) + 3  # and the top-level ones (smoke, mqar_sweep, transformer_340m_ldc16k)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_config_composes(experiment):
    cfg = _compose([f"experiment={experiment}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    validate_train_config(cfg)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_recipe(name):
    preset, layers = PAPER[name]
    cfg = _compose([f"experiment=loglinear_paper/{name}"])
    tr, optim = cfg.trainer, cfg.optim
    assert cfg.model.name == preset and cfg.model.num_layers == layers and cfg.model.hidden_size == 1536
    assert tr.seq_len == 16384 and cfg.model.max_position_embeddings == 16384
    assert cfg.data.name == "ldc" and any("Long-Data-Collections" in p for s in cfg.data.sources for p in s.paths)
    rows_per_step = tr.batch_size * tr.grad_accum * GPUS
    tokens_per_step = rows_per_step * tr.seq_len
    assert rows_per_step == 32 and tokens_per_step == 524_288
    assert tr.max_steps == 95_367 == int(50e9 // tokens_per_step)
    assert 50e9 - tokens_per_step < tokens_per_step * tr.max_steps <= 50e9
    assert optim.name == "adamw" and optim.lr == 3e-4 and list(optim.betas) == [0.9, 0.95]
    assert optim.weight_decay == 0.1 and optim.schedule == "cosine" and optim.warmup_steps == 1024
    assert optim.min_lr_ratio == 0.1 and optim.grad_clip == 1.0
    evals = final_eval_configs(cfg)
    assert [n for n, _ in evals] == ["ppl_T16384", "ppl_T32768", "ruler"]  # not the eval group's lone suite
    (_, ppl16), (_, ppl32), (_, ruler) = evals
    assert (ppl16.suite, ppl16.seq_len, ppl32.suite, ppl32.seq_len) == (
        "ppl_by_position", 16384, "ppl_by_position", 32768)
    assert ruler.suite == "ruler" and list(ruler.lengths) == [4096, 8192, 16384] and len(ruler.tasks) == 8
    text = (CONF / "experiment" / "loglinear_paper" / f"{name}.yaml").read_text()
    assert (f"accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 8 train.py "
            f"experiment=loglinear_paper/{name}") in text


def test_paper_runs_have_distinct_names():
    names = {_compose([f"experiment=loglinear_paper/{n}"]).name for n in PAPER}
    assert len(names) == len(PAPER)  # runs/<name> never mixes (or resumes) two models of the grid


def test_paper_models_have_the_expected_size_on_meta():
    counts = {}
    for name, (_, layers) in PAPER.items():
        model = _build_on_meta(_compose([f"experiment=loglinear_paper/{name}"]))
        params = list(model.parameters())
        assert all(p.device.type == "meta" for p in params)
        assert len(model.model.layers) == layers
        assert model.model.embed_tokens.weight.shape == (VOCAB, 1536)
        counts[name] = sum(p.numel() for p in params)
        assert 0.55e9 < counts[name] < 0.85e9, (name, counts[name])  # the papers' ~760M class (with an 8K vocab)
    # 3 more transformer layers: attention 4 d^2, SwiGLU 3 d x 4096, two RMSNorms
    d = 1536
    assert counts["transformer_24l"] - counts["transformer_21l"] == 3 * (4 * d * d + 3 * d * 4096 + 2 * d)
    # log-linear Mamba-2 adds, per layer, in_proj outputs dl and the scales L: heads x levels each, with 48 heads
    # (2 d / 64) and 15 levels (bit_length(16384 - 1) + 1, from max_position_embeddings = the training length)
    heads, levels = 2 * d // 64, 15
    assert counts["loglinear_mamba2"] - counts["mamba2"] == 21 * (heads * levels * d + heads * levels)
    assert counts["loglinear_gated_deltanet"] > counts["gated_deltanet"]
    assert counts["transformer_21l"] < counts["hla_transformer"] < counts["transformer_24l"] < counts["mamba2"]


def test_final_evals_compose_from_the_command_line_and_bad_suites_are_refused():
    cfg = _compose(["+eval@trainer.final_evals.ruler_short=ruler", "trainer.final_evals.ruler_short.lengths=[512]"])
    assert [(n, c.suite) for n, c in final_eval_configs(cfg)] == [("ruler_short", "ruler")]
    assert list(cfg.trainer.final_evals.ruler_short.lengths) == [512]
    validate_train_config(cfg)
    with pytest.raises(ConfigError, match=r"trainer\.final_evals\.bad has suite='nope'"):
        validate_train_config(_compose(["+trainer.final_evals.bad.suite=nope"]))


def test_final_eval_alone_and_configs_without_final_evals_keep_working():
    cfg = _compose(["trainer.final_eval=true"])
    assert [(n, c.suite) for n, c in final_eval_configs(cfg)] == [(None, "ppl_by_position")]
    old = OmegaConf.create({"trainer": {"final_eval": True}, "eval": {"suite": "ruler"}})  # a config from before
    assert [(n, c.suite) for n, c in final_eval_configs(old)] == [(None, "ruler")]
    assert final_eval_configs(OmegaConf.create({"trainer": {"final_eval": False}, "eval": {}})) == []


def test_a_shrunken_paper_run_ends_with_every_final_eval(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir = tmp_path / "run"
    cfg = small_cfg(
        "experiment=loglinear_paper/loglinear_mamba2", "model/size=tiny", "data=default", "trainer.seq_len=64",
        "trainer.batch_size=2", "trainer.grad_accum=1", "trainer.max_steps=2", "trainer.val_every=0",
        "trainer.val_batches=1", "trainer.save_every=0", "optim.warmup_steps=1",
        "trainer.final_evals.ppl_T16384.seq_len=64", "trainer.final_evals.ppl_T16384.num_documents=2",
        "trainer.final_evals.ppl_T32768.seq_len=128", "trainer.final_evals.ppl_T32768.num_documents=2",
        "trainer.final_evals.ruler.lengths=[320]", "trainer.final_evals.ruler.num_samples=1",
        "trainer.final_evals.ruler.max_new_tokens=8", "trainer.final_evals.ruler.tasks=[niah_single_1,niah_multivalue]")
    assert cfg.model.name == "loglinear_mamba2" and cfg.model.num_layers == 4 and not cfg.trainer.final_eval
    summary = run_train(cfg, run_dir)
    assert summary["step"] == 2 and "eval" not in summary
    evals = summary["evals"]
    assert list(evals) == ["ppl_T16384", "ppl_T32768", "ruler"]
    assert Path(evals["ppl_T16384"]["json"]).parent == run_dir.resolve() / "eval" / "ppl_by_position_T64"
    assert Path(evals["ppl_T32768"]["json"]).parent == run_dir.resolve() / "eval" / "ppl_by_position_T128"
    for key in ("ppl_T16384", "ppl_T32768"):
        report = json.loads(Path(evals[key]["json"]).read_text())
        assert report["ppl"] == pytest.approx(evals[key]["ppl"]) and evals[key]["ppl"] > 1
        assert report["num_documents"] == 2 and report["train_len"] == 64
        assert Path(evals[key]["png"]).stat().st_size > 0
    assert len(json.loads(Path(evals["ppl_T32768"]["json"]).read_text())["per_position_nll"]) == 128
    ruler = json.loads(Path(evals["ruler"]["json"]).read_text())
    assert Path(evals["ruler"]["json"]).parent.name == "ruler_T320"
    assert ruler["lengths"] == [320] and ruler["tasks"] == ["niah_single_1", "niah_multivalue"]
    assert len(ruler["samples"]) == 2 and ruler["average"] == pytest.approx(evals["ruler"]["average"])
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert list(on_disk["evals"]) == ["ppl_T16384", "ppl_T32768", "ruler"]
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert list(saved.trainer.final_evals) == ["ppl_T16384", "ppl_T32768", "ruler"]
    assert os.path.isdir(summary["checkpoint"])


@pytest.mark.parametrize("model", ["transformer", "mamba2", "loglinear_mamba2", "gated_deltanet",
                                   "loglinear_gated_deltanet"])
def test_longctx_small_trains_at_4k_and_reports_ppl_and_ruler(model):
    cfg = _compose(["experiment=longctx_small", f"model={model}"])
    validate_train_config(cfg)
    assert cfg.model.name == model and cfg.model.size_name == "125m"
    assert cfg.trainer.seq_len == cfg.model.max_position_embeddings == 4096
    reports = final_eval_configs(cfg)
    assert {name: r.get("seq_len", r.get("lengths")) for name, r in reports} == {
        "ppl_T4096": 4096, "ppl_T8192": 8192, "ruler": [2048, 4096, 8192]}
    # a quarter of the training rows are needle documents of exactly the tasks RULER evaluates
    mix = OmegaConf.to_container(cfg.data.retrieval_mix)
    assert mix == {"fraction": 0.25, "tasks": dict(reports)["ruler"]["tasks"]}
