"""A checkpoint moves between FSDP-sharded and plain (one process, DDP) runs: training.checkpoint reads the other
layout's whole weights and optimizer state and hands them to torch.distributed.checkpoint.state_dict, which shards
them as this run's model is. Checked with FSDP2 in a one-process gloo group on CPU: plain -> sharded -> plain gives
back every weight and every optimizer tensor exactly, and the same next step."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import models
from training import build_optimizer
from training.checkpoint import (
    FSDP_MODEL_DIR,
    FSDP_OPTIMIZER_DIR,
    load_across_layouts,
    saved_layout,
)

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
        "mixer": "mamba2", "mixer_kwargs": {"head_dim": 32, "state_size": 16}}
OPTIM = OmegaConf.create({"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8,
                          "no_decay": ["bias", "norm", "A_log", "dt_bias", "D"]})
FULL = StateDictOptions(full_state_dict=True)


@pytest.fixture()
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = models.build_model(TINY)
    return model, build_optimizer(model, OPTIM, on_cuda=False)


def _step(model, optimizer, seed=1):
    ids = torch.randint(0, TINY["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _full_state(model, optimizer):
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in model.state_dict().items()}
    return weights, get_optimizer_state_dict(model, optimizer, options=FULL)


def _assert_same(a, b):
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["state"].keys() == ob["state"].keys()
    for name, st in oa["state"].items():
        for key, val in st.items():
            assert torch.equal(torch.as_tensor(val), torch.as_tensor(ob["state"][name][key])), (name, key)
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]
    assert [g["weight_decay"] for g in oa["param_groups"]] == [g["weight_decay"] for g in ob["param_groups"]]


def _save_plain(ckpt, model, optimizer):
    acc = ckpt / "accelerate"
    acc.mkdir(parents=True)
    model.save_pretrained(ckpt / "model", safe_serialization=True)  # the weights, stored once
    torch.save(optimizer.state_dict(), acc / "optimizer.bin")


def _save_sharded(ckpt, model, optimizer, weights):
    """What accelerate.save_state writes for FSDP2 with SHARDED_STATE_DICT, plus the gathered export."""
    acc = ckpt / "accelerate"
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(acc / FSDP_MODEL_DIR)))
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
             storage_writer=dcp.FileSystemWriter(str(acc / FSDP_OPTIMIZER_DIR)))
    from safetensors.torch import save_file

    (ckpt / "model").mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(ckpt / "model" / "model.safetensors"))


def _fully_shard(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def test_plain_to_sharded_and_back_restores_weights_and_optimizer(gloo_group, tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    reference = _full_state(model, optimizer)
    _save_plain(tmp_path / "plain", model, optimizer)
    assert saved_layout(tmp_path / "plain" / "accelerate") == "plain"

    sharded = _fully_shard(models.build_model(TINY))  # other initial weights: everything must come from the file
    sharded_opt = build_optimizer(sharded, OPTIM, on_cuda=False)
    load_across_layouts(tmp_path / "plain", "plain", sharded, sharded_opt)
    assert any(hasattr(p, "full_tensor") for p in sharded.parameters())  # still sharded (DTensors)
    _assert_same(_full_state(sharded, sharded_opt), reference)

    _save_sharded(tmp_path / "sharded", sharded, sharded_opt, reference[0])
    assert saved_layout(tmp_path / "sharded" / "accelerate") == "fsdp-sharded"
    back, back_opt = _model_and_optimizer(seed=3)
    load_across_layouts(tmp_path / "sharded", "fsdp-sharded", back, back_opt)
    _assert_same(_full_state(back, back_opt), reference)

    # the restored run takes the step the original would have taken
    _step(model, optimizer, seed=2)
    _step(back, back_opt, seed=2)
    _assert_same(_full_state(back, back_opt), _full_state(model, optimizer))


def test_an_optimizer_of_another_model_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    _save_plain(tmp_path / "plain", model, optimizer)
    other = models.build_model({**TINY, "num_layers": 3})
    with pytest.raises(ValueError, match="written for another model"):
        load_across_layouts(tmp_path / "plain", "plain", other, build_optimizer(other, OPTIM, on_cuda=False))


def test_a_checkpoint_without_optimizer_state_is_named(tmp_path):
    (tmp_path / "accelerate").mkdir()
    with pytest.raises(FileNotFoundError, match="no optimizer or model state"):
        saved_layout(tmp_path / "accelerate")


def test_sharded_into_a_ddp_model(gloo_group, tmp_path):
    """FSDP -> DDP: the DDP wrapper's "module." prefix is not part of the saved names."""
    from torch.nn.parallel import DistributedDataParallel

    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    reference = _full_state(model, optimizer)
    sharded = _fully_shard(models.build_model(TINY))
    sharded_opt = build_optimizer(sharded, OPTIM, on_cuda=False)
    _save_plain(tmp_path / "plain", model, optimizer)
    load_across_layouts(tmp_path / "plain", "plain", sharded, sharded_opt)
    _save_sharded(tmp_path / "sharded", sharded, sharded_opt, reference[0])

    torch.manual_seed(5)
    ddp = DistributedDataParallel(models.build_model(TINY))
    ddp_opt = build_optimizer(ddp.module, OPTIM, on_cuda=False)
    load_across_layouts(tmp_path / "sharded", "fsdp-sharded", ddp, ddp_opt)
    _assert_same(_full_state(ddp.module, ddp_opt), reference)
