"""trainer.init_from: a new run starts from another run's weights (a curriculum's next stage, context extension), with
a fresh optimizer, schedule and data stream; weights or a tokenizer that do not fit are refused, naming why."""
import pytest

from tests.training.helpers import metrics, run_train, small_cfg


def _val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val/loss"] for r in metrics(run_dir) if "val/loss" in r}


@pytest.fixture(scope="module")
def first_stage(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("init") / "stage1"
    run_train(small_cfg("trainer.save_every=0"), run_dir)
    return run_dir


def test_the_new_run_starts_at_the_checkpoint_weights_and_step_zero(first_stage, tmp_path, capsys):
    summary = run_train(small_cfg("trainer.max_steps=2", f"trainer.init_from={first_stage}"), tmp_path / "stage2")
    out = capsys.readouterr().out
    assert summary["step"] == 2 and "optimizer, schedule and data start fresh" in out
    # the same held-out rows: the second stage's validation before its first step is the first stage's last
    assert _val_losses(tmp_path / "stage2")[0] == pytest.approx(_val_losses(first_stage)[6], rel=1e-6)


def test_a_longer_context_with_another_rope_base_keeps_the_weights_and_says_what_changed(first_stage, tmp_path,
                                                                                         capsys):
    fresh = tmp_path / "fresh"
    run_train(small_cfg("trainer.max_steps=1", "trainer.seq_len=96"), fresh)
    run_train(small_cfg("trainer.max_steps=1", "trainer.seq_len=96", "model.rope_theta=50000.0",
                        f"trainer.init_from={first_stage}"), tmp_path / "longer")
    assert "init: model.rope_theta: 10000.0 -> 50000.0" in capsys.readouterr().out
    assert _val_losses(tmp_path / "longer")[0] < _val_losses(fresh)[0] - 1.0  # trained weights, not an init


def test_another_architecture_is_refused_naming_the_difference(first_stage, tmp_path):
    from training.checkpoint import InitFromError

    with pytest.raises(InitFromError, match=r"(?s)weights of another model.*model\.num_layers: 4 -> 3.*init_from=null"):
        run_train(small_cfg("model.num_layers=3", f"trainer.init_from={first_stage}"), tmp_path / "other")
    assert not (tmp_path / "other" / "checkpoints").exists()


def test_a_tokenizer_with_other_pieces_is_refused(first_stage):
    from omegaconf import OmegaConf

    import models
    from training.checkpoint import InitFromError, init_weights_from, load_checkpoint_tokenizer
    from training.config import model_kwargs

    cfg = OmegaConf.to_container(OmegaConf.load(first_stage / "config.yaml"), resolve=True)
    tokenizer = load_checkpoint_tokenizer(first_stage)
    model = models.build_model(model_kwargs(OmegaConf.create(cfg["model"]), tokenizer.vocab_size, tokenizer))
    assert init_weights_from(model, first_stage, cfg, tokenizer)[0].startswith("init: weights from")

    class Shuffled:  # the same size and name, two ids swapped
        name, vocab_size = tokenizer.name, tokenizer.vocab_size

        def decode(self, ids):
            swap = {5: 6, 6: 5}
            return tokenizer.decode([swap.get(i, i) for i in ids])

    with pytest.raises(InitFromError, match="maps ids to other pieces"):
        init_weights_from(model, first_stage, cfg, Shuffled())


def test_a_resumed_run_continues_from_its_own_checkpoint_not_init_from(first_stage, tmp_path, capsys):
    run_dir = tmp_path / "stage2"
    run_train(small_cfg("trainer.max_steps=3", "trainer.save_every=3"), run_dir)
    summary = run_train(small_cfg("trainer.max_steps=4", f"trainer.init_from={first_stage}"), run_dir)
    assert summary["step"] == 4
    assert "trainer.init_from is not read: the run resumes from its own checkpoint" in capsys.readouterr().out


def test_init_from_must_be_a_path():
    from training.config import ConfigError, validate_train_config

    with pytest.raises(ConfigError, match="trainer.init_from"):
        validate_train_config(small_cfg("trainer.init_from=3"))
