"""Resuming with changed settings: model, data, tokenizer, optimiser, schedule and seed differences stop the run
with their list unless accepted by trainer.resume_override; max_steps, intervals, the logger and the final evals are
applied and listed."""
import pytest
from omegaconf import OmegaConf

from tests.training.helpers import CONF, small_cfg
from training.resume_check import ResumeConfigError, check_resume_config, compare_configs


@pytest.fixture(scope="module")
def saved():
    return OmegaConf.to_container(small_cfg(), resolve=True)


def _new(*overrides):
    return OmegaConf.to_container(small_cfg(*overrides), resolve=True)


def test_same_config_has_no_differences(saved):
    assert compare_configs(saved, _new()) == ([], [])


@pytest.mark.parametrize("override,key", [
    ("optim.lr=1e-4", "optim.lr"), ("optim.warmup_steps=5", "optim.warmup_steps"), ("seed=1", "seed"),
    ("model.hidden_size=96", "model.hidden_size"), ("data.max_document_chars=1000", "data.max_document_chars"),
    ("tokenizer.vocab_size=512", "tokenizer.vocab_size"), ("trainer.seq_len=32", "trainer.seq_len"),
    ("trainer.mixed_precision=bf16", "trainer.mixed_precision"),
])
def test_run_changing_settings_block(saved, override, key):
    blocking, applied = compare_configs(saved, _new(override))
    assert [line.split(":")[0] for line in blocking] == [key]
    assert {line.split(":")[0] for line in applied} <= {"name"}  # the default name holds the sequence length
    with pytest.raises(ResumeConfigError, match=rf"(?s){key}: .* -> .*trainer.resume_override=\[{key}\]"):
        check_resume_config(saved, _new(override))


@pytest.mark.parametrize("override,key", [
    ("trainer.max_steps=12", "trainer.max_steps"), ("trainer.log_every=2", "trainer.log_every"),
    ("trainer.val_every=4", "trainer.val_every"), ("trainer.save_every=2", "trainer.save_every"),
    ("trainer.batch_size=2", "trainer.batch_size"), ("trainer.device=cpu", "trainer.device"),
    ("trainer.compile=true", "trainer.compile"),
    ("logger=wandb", "logger.name"), ("trainer.progress_bar=true", "trainer.progress_bar"),
    ("trainer.final_eval=true", "trainer.final_eval"),
])
def test_bookkeeping_settings_are_applied_and_listed(saved, override, key):
    blocking, applied = compare_configs(saved, _new(override))
    assert blocking == [] and key in [line.split(":")[0] for line in applied]
    assert check_resume_config(saved, _new(override)) == applied


def test_a_setting_the_checkpoint_lacks_is_a_difference(saved):
    old = {**saved, "optim": {k: v for k, v in saved["optim"].items() if k != "warmup_steps"}}
    blocking, _ = compare_configs(old, saved)
    assert blocking == [f"optim.warmup_steps: (not set) -> {saved['optim']['warmup_steps']!r}"]


def test_override_accepts_named_keys_prefixes_or_all(saved):
    new = _new("optim.lr=1e-4", "seed=3", "trainer.max_steps=9")
    with pytest.raises(ResumeConfigError, match=r"seed: 0 -> 3") as info:
        check_resume_config(saved, new, override=["optim.lr"])
    assert "optim.lr" not in str(info.value)
    lines = check_resume_config(saved, new, override=["optim", "seed"])
    assert lines == [("trainer.max_steps: 6 -> 9 (the lr schedule's decay is recomputed for the new length from this "
                      "step on)"), "optim.lr: 0.003 -> 0.0001 (accepted by trainer.resume_override)",
                     "seed: 0 -> 3 (accepted by trainer.resume_override)"]
    assert check_resume_config(saved, new, override="all") == lines
    assert check_resume_config(saved, new, override="optim.lr,seed") == lines
    with pytest.raises(ResumeConfigError):
        check_resume_config(saved, new, override=["optim.lr_x"])  # a prefix matches whole key parts only


def _without(cfg, section, key):
    return {**cfg, section: {k: v for k, v in cfg[section].items() if k != key}}


def test_a_setting_the_checkpoint_lacks_at_its_default_is_no_difference(saved):
    old = _without(saved, "data", "max_document_chars")  # a checkpoint written before the setting existed
    blocking, applied = compare_configs(old, saved, defaults=_new())
    assert blocking == []
    assert applied == ["data.max_document_chars: absent from the checkpoint's config, taken at its default 10000000"]
    assert check_resume_config(old, saved, defaults=lambda: _new()) == applied  # a function: called when needed


def test_a_setting_the_checkpoint_lacks_with_another_value_blocks(saved):
    old = _without(saved, "data", "max_document_chars")
    new = _new("data.max_document_chars=1000")
    with pytest.raises(ResumeConfigError, match=r"data\.max_document_chars: \(not set\) -> 1000 \(absent from the "
                                                r"checkpoint's config; its default is 10000000\)"):
        check_resume_config(old, new, defaults=_new())
    assert check_resume_config(old, new, override=["data"], defaults=_new())[0].endswith(
        "(accepted by trainer.resume_override)")


def test_defaults_are_asked_for_only_when_the_checkpoint_lacks_a_key(saved):
    def fail():
        raise AssertionError("defaults composed for a checkpoint that lacks no key")

    assert compare_configs(saved, _new("trainer.max_steps=9"), defaults=fail)[0] == []


def test_composed_defaults_keep_the_group_choices_and_drop_the_values():
    from training.config import composed_defaults

    d = composed_defaults(["data=mqar", "model/size=tiny", "+model/mqar=mamba2", "optim.lr=1e-4", "trainer.seq_len=32",
                           "data.vocab_size=7", "hydra.run.dir=/elsewhere"])
    assert d["data"]["type"] == "mqar" and d["model"]["name"] == "mamba2" and d["model"]["size_name"] == "tiny"
    assert d["optim"]["lr"] == OmegaConf.load(CONF / "optim" / "adamw.yaml").lr
    assert d["trainer"]["seq_len"] == OmegaConf.load(CONF / "trainer" / "default.yaml").seq_len
    assert d["data"]["vocab_size"] == OmegaConf.load(CONF / "data" / "mqar.yaml").vocab_size
