"""Under FSDP2 clip_grad_norm_ returns a DTensor, which cannot go through the all_reduce of the step's skip flag
(the two-H200 FSDP run died there). training.local_grad_norm makes it a plain tensor; checked in a one-process
gloo group on CPU, where the same all_reduce of the DTensor fails."""
import pytest
import torch
import torch.distributed as dist

from training import local_grad_norm


@pytest.fixture()
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_grad_norm_becomes_a_plain_tensor_that_all_reduces(gloo_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    grads = [DTensor.from_local(torch.tensor([3.0, 4.0]), mesh, [Shard(0)])]
    norm = torch.nn.utils.get_total_norm(grads)
    assert isinstance(norm, DTensor)
    with pytest.raises(NotImplementedError):  # what train.py hit: no sharding strategy for c10d.allreduce_
        dist.all_reduce(torch.isfinite(norm).float(), op=dist.ReduceOp.MIN)
    local = local_grad_norm(norm, torch.device("cpu"))
    assert not isinstance(local, DTensor) and local.item() == pytest.approx(5.0)
    flag = torch.isfinite(local).float()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    assert flag.item() == 1.0


def test_plain_grad_norms_pass_through():
    assert local_grad_norm(2.5, torch.device("cpu")).item() == 2.5
    t = torch.tensor(7.0)
    assert local_grad_norm(t, torch.device("cpu")).item() == 7.0
