"""train.py with data=mqar: MQAR validation metrics, best accuracy in the summary, early stopping, the vocabulary from
the data config, the Hydra configs (data=mqar, model/size=mqar, experiment=mqar_sweep) and a real -m sweep into
benchmarks/mqar_table.py."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from models.conv import ShortConv
from tests.training.helpers import CONF, REPO, metrics, run_train, small_cfg
from training import ConfigError, validate_train_config

TINY_DATA = [
    "data=mqar", "model/size=mqar", "model.hidden_size=32", "data.vocab_size=64", "trainer.seq_len=16",
    "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:4096},{seq_len:16,num_kv_pairs:4,num_examples:4096}]",
    "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:64},{seq_len:16,num_kv_pairs:4,num_examples:64}]",
    "trainer.val_batches=null",  # every test example (SMALL's val_batches=2 would validate on a subset)
]
MQAR_MODELS = ["transformer", "mamba2", "loglinear_mamba2", "gated_deltanet", "loglinear_gated_deltanet",
               "hla_transformer", "hla_mamba2", "hla_gated_deltanet"]
SHELLS_WITHOUT_CONV = {"transformer", "hla_transformer"}  # the MQAR recipe puts a conv before these mixers only


def test_short_run_logs_accuracy_per_slice_and_takes_the_vocabulary_from_the_data(tmp_path):
    cfg = small_cfg(*TINY_DATA, "model=mamba2", "model.mixer_kwargs.head_dim=16")
    summary = run_train(cfg, tmp_path / "run")
    rows = [r for r in metrics(tmp_path / "run") if "val/mqar_acc" in r]
    assert [r["step"] for r in rows] == [0, 3, 6]
    for r in rows:
        assert set(r) >= {"val/loss", "val/mqar_acc", "val/mqar_acc/T16_kv2", "val/mqar_acc/T16_kv4"}
        assert 0 <= r["val/mqar_acc"] <= 1
        # 64 examples a slice: the mean over examples is the slices' mean; over queries, 64 x 2 and 64 x 4 pooled
        assert r["val/mqar_acc"] == pytest.approx((r["val/mqar_acc/T16_kv2"] + r["val/mqar_acc/T16_kv4"]) / 2)
        pooled = (128 * r["val/mqar_acc/T16_kv2"] + 256 * r["val/mqar_acc/T16_kv4"]) / 384
        assert r["val/mqar_query_acc"] == pytest.approx(pooled)
    assert summary["best_mqar_acc"] == max(r["val/mqar_acc"] for r in rows)
    assert summary["val_loss"] == rows[-1]["val/loss"]
    assert summary["tokens"] == 6 * 4 * 16  # counted from the batches (T = 16), not trainer.seq_len
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_00000006" / "model" / "config.json").read_text())
    assert saved["vocab_size"] == 64 and saved["mlp"] is False and saved["pre_conv"] == 4
    assert saved["num_layers"] == 2


def test_transformer_learns_mqar_and_stops_early(tmp_path):
    """A 2-layer attention model learns recall only if the training labels point the loss at the query positions."""
    cfg = small_cfg(*TINY_DATA, "model=transformer", "trainer.batch_size=64", "trainer.max_steps=600",
                    "trainer.val_every=50", "trainer.log_every=50", "trainer.save_every=0", "optim.lr=1e-2",
                    "optim.warmup_steps=10", "optim.weight_decay=0.0", "trainer.early_stop_metric=val/mqar_acc",
                    "trainer.early_stop_threshold=0.8")
    summary = run_train(cfg, tmp_path / "run")
    rows = [r for r in metrics(tmp_path / "run") if "val/mqar_acc" in r]
    assert summary["early_stopped"] is True and summary["step"] < 600 and summary["step"] % 50 == 0
    assert summary["best_mqar_acc"] >= 0.8 and rows[-1]["step"] == summary["step"]
    assert [r["step"] for r in rows].count(summary["step"]) == 1  # no second validation of the same step
    assert rows[0]["val/mqar_acc"] < 0.1


def test_early_stop_configuration_errors(tmp_path):
    with pytest.raises(ConfigError, match="early_stop_threshold"):
        validate_train_config(small_cfg(*TINY_DATA, "trainer.early_stop_metric=val/mqar_acc"))
    with pytest.raises(ValueError, match="not a validation metric"):
        run_train(small_cfg(*TINY_DATA, "model=transformer", "trainer.early_stop_metric=val/accuracy",
                            "trainer.early_stop_threshold=0.5"), tmp_path / "run")


def _compose(overrides, hydra=False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=hydra)


def test_data_and_size_configs_compose():
    cfg = _compose(["data=mqar", "model=gated_deltanet", "model/size=mqar"])
    validate_train_config(cfg)
    assert cfg.data.type == "mqar" and cfg.data.vocab_size == 8192 and cfg.data.power_a == 0.01
    assert [(s.seq_len, s.num_kv_pairs) for s in cfg.data.test] == [(256, n) for n in (4, 8, 16, 32, 64)]
    assert cfg.model.num_layers == 2 and cfg.model.mlp is False and cfg.model.pre_conv == 4
    assert cfg.model.max_position_embeddings == 256


def test_sweep_experiment_composes_for_every_model_and_width():
    import models

    cfg = _compose(["experiment=mqar_sweep"], hydra=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert params["+model/mqar"].split(",") == MQAR_MODELS
    assert params["model.hidden_size"].split(",") == ["16", "32", "64"]
    assert len(params["seed"].split(",")) == 5 and len(params["optim.lr"].split(",")) >= 3
    assert cfg.trainer.early_stop_metric == "val/mqar_acc" and cfg.trainer.early_stop_threshold == 0.99
    assert cfg.data.name == "mqar" and cfg.model.size_name == "mqar" and cfg.trainer.seq_len == 256
    for name in MQAR_MODELS:
        for width in (16, 32, 64):
            cfg = _compose(["experiment=mqar_sweep", f"+model/mqar={name}", f"model.hidden_size={width}"], hydra=True)
            validate_train_config(cfg)
            assert cfg.model.name == name
            assert cfg.hydra.run.dir == f"{cfg.paths.runs}/mqar/{name}-d{width}-lr{cfg.optim.lr}-s0"
            kwargs = OmegaConf.to_container(cfg.model, resolve=True)
            with torch.device("meta"):
                model = models.build_model({**kwargs, "vocab_size": 8192})
            assert len(model.model.layers) == 2 and all(b.mlp is None for b in model.model.layers)
            # The recipe: tied embeddings, and one short conv on each mixer's inputs (its own, else a pre_conv).
            assert model.lm_head.weight is model.model.embed_tokens.weight
            for block in model.model.layers:
                own_conv = any(isinstance(m, ShortConv) for m in block.mixer.modules())
                assert own_conv == (name not in SHELLS_WITHOUT_CONV), name
                assert (block.pre_conv is None) == own_conv, name
                assert own_conv or block.pre_conv.kernel_size == 4


def test_multirun_sweep_and_table(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    params = 'hydra.sweeper.params={+model/mqar:"transformer,mamba2",model.hidden_size:16,optim.lr:"1e-3,3e-3",seed:"0,1"}'
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "experiment=mqar_sweep", params, f"hydra.sweep.dir={sweep}",
           "data.vocab_size=64",
           "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:8}]",
           "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:4}]", "trainer.max_steps=2", "trainer.batch_size=4",
           "trainer.val_every=1", "trainer.progress_bar=false", "trainer.save_final=false", "logger=none"]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 8
    seen = set()
    for job in jobs:
        cfg = yaml.safe_load((job / "config.yaml").read_text())
        summary = json.loads((job / "summary.json").read_text())
        assert "best_mqar_acc" in summary
        seen.add((cfg["model"]["name"], cfg["optim"]["lr"], cfg["seed"]))
    assert len(seen) == 8
    table = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mqar_table.py"), str(sweep)], check=False,
                           env=env, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert (sweep / "mqar_table.md").is_file() and "8 runs" in table.stdout
    csv_rows = (sweep / "mqar_table.csv").read_text().splitlines()
    assert csv_rows[0].startswith("model,variant,width,best_lr") and len(csv_rows) == 3


def test_eval_py_mqar_matches_the_final_validation(tmp_path):
    run_dir = tmp_path / "run"
    run_train(small_cfg(*TINY_DATA, "model=gated_deltanet", "model.mixer_kwargs.head_dim=16", "eval=mqar",
                        "trainer.final_eval=true"), run_dir)
    final = [r for r in metrics(run_dir) if "val/mqar_acc" in r][-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["acc"] == pytest.approx(final["val/mqar_acc"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    out = tmp_path / "eval_out"
    proc = subprocess.run([sys.executable, "eval.py", f"checkpoint={run_dir}", "eval=mqar", f"eval.out_dir={out}",
                           "logger=none"], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "T16_kv2" in proc.stdout and "T16_kv4" in proc.stdout and "all" in proc.stdout
    result = json.loads((out / "mqar.json").read_text())
    assert result["acc"] == pytest.approx(final["val/mqar_acc"])
    assert result["slices"]["T16_kv4"]["acc"] == pytest.approx(final["val/mqar_acc/T16_kv4"])
    assert result["num_queries"] == 64 * 2 + 64 * 4


def test_eval_mqar_refuses_text_data(tmp_path):
    from training.evaluation import evaluate_checkpoint

    run_dir = tmp_path / "run"
    run_train(small_cfg("trainer.max_steps=1", "trainer.save_every=0"), run_dir)
    with pytest.raises(ValueError, match="eval=mqar needs MQAR data"):
        evaluate_checkpoint(run_dir, _compose(["eval=mqar"]).eval, device=torch.device("cpu"))


def test_mqar_resume_is_bit_exact_and_keeps_the_best(tmp_path):
    from safetensors.torch import load_file

    overrides = (*TINY_DATA, "model=mamba2", "model.mixer_kwargs.head_dim=16", "trainer.val_every=2")
    full = tmp_path / "full"
    whole = run_train(small_cfg(*overrides), full)
    part = tmp_path / "part"
    shutil.copytree(full / "checkpoints" / "step_00000003", part / "checkpoints" / "step_00000003")
    (part / "checkpoints" / "latest").write_text("step_00000003")
    earlier = [r for r in metrics(full) if "val/mqar_acc" in r and r["step"] <= 3]
    marks = [{"step": 1, "val/mqar_acc": 0.97}, {"step": 5, "val/mqar_acc": 2.0}]  # before / after the checkpoint
    (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*earlier, *marks]))
    resumed = run_train(small_cfg(*overrides), part)
    a = load_file(str(full / "checkpoints" / "step_00000006" / "model" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_00000006" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole["best_mqar_acc"] < 0.97 and resumed["best_mqar_acc"] == 0.97 and resumed["best_mqar_acc_step"] == 1
    assert resumed["tokens"] == whole["tokens"]
    final = lambda rows: [r["val/mqar_acc"] for r in rows if r["step"] == 6 and "val/mqar_acc" in r]
    assert final(metrics(part)) == final(metrics(full)) and len(final(metrics(full))) == 1
