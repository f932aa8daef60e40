"""hilo's FSDP2 settings on top of accelerate's FSDP launch (conf/accelerate/fsdp.yaml): the precision policy, the
sharding (full, or hybrid: replicated across nodes, sharded within one), and the blocks' all-gather prefetching.

    fsdp_plugin(tr, mixed_precision, use_cpu)   accelerate's FullyShardedDataParallelPlugin with hilo's precision
    parallelism_config(tr, use_cpu)             accelerate's ParallelismConfig for trainer.fsdp_sharding=hybrid
    set_prefetch(model, forward, backward)      each Block's explicit all-gather prefetches, after accelerate.prepare

The trainer.fsdp_* fields are described in docs/configuration.md and docs/distributed.md. Under a launch without
FSDP (one process, DDP, CPU processes) fsdp_plugin and parallelism_config return None and the fields other than
fsdp_sharding are not read; fsdp_sharding=hybrid there is an error (it would silently train unsharded).
"""
from __future__ import annotations

import os

import torch
from accelerate import FullyShardedDataParallelPlugin

SHARDINGS = ("full", "hybrid")
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class FSDPConfigError(ValueError):
    pass


def fsdp_launch() -> bool:
    """True under `accelerate launch` with an FSDP config (accelerate says so through ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_plugin(tr, mixed_precision: str, use_cpu: bool):
    """Under `accelerate launch` with an FSDP config, its plugin with hilo's precision policy; None otherwise.

    accelerate's own policy for mixed_precision=bf16 keeps every parameter in bf16 and reduces gradients in bf16: the
    norms' and gates' elementwise math and the gradient sums then round to bf16, and a two-H200 run drifted from
    the one-GPU loss (5.34 against 5.05 at step 50, where DDP gave 5.10). Here gradients reduce in fp32 unless
    trainer.fsdp_reduce_dtype=bf16 asks for bf16 (half the reduce-scatter traffic, an opt-in: docs/distributed.md
    gives its measured drift), and trainer.fsdp_param_dtype=fp32 (the default) gathers fp32 parameters so autocast
    computes exactly as on one GPU; bf16 halves the all-gather traffic. accelerate wraps a DDP or single-device
    model's forward in autocast but not an FSDP2 model's (it relies on param_dtype), so the loop enters
    accelerator.autocast() itself: without it the fp32-gather run computed in fp32, ten times slower (5.5K tokens/s
    on two H200s)."""
    if use_cpu or not fsdp_launch():
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy  # here: older torch has it elsewhere, used under FSDP only

    param_dtype = torch.bfloat16 if tr.get("fsdp_param_dtype", "fp32") == "bf16" and mixed_precision == "bf16" else None
    reduce_dtype = REDUCE_DTYPES[tr.get("fsdp_reduce_dtype") or "fp32"]
    return FullyShardedDataParallelPlugin(
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))


def hybrid_sizes(world_size: int, shard_size: int | None, local_world_size: int | None) -> tuple[int, int]:
    """(replicas, shard size) of trainer.fsdp_sharding=hybrid over world_size processes: each parameter is sharded
    over shard_size processes (null: the processes of one node, local_world_size) and replicated over the
    world_size / shard_size groups. Raises FSDPConfigError when the split is impossible or is not hybrid."""
    shard = shard_size or local_world_size
    where = "trainer.fsdp_shard_size" if shard_size else "the processes per node (LOCAL_WORLD_SIZE)"
    if not shard:
        raise FSDPConfigError("trainer.fsdp_sharding=hybrid: the processes per node are unknown (LOCAL_WORLD_SIZE is "
                              "not set: launch with accelerate launch or torchrun), set trainer.fsdp_shard_size=N")
    if world_size % shard:
        raise FSDPConfigError(f"trainer.fsdp_sharding=hybrid: {where} = {shard} does not divide the {world_size} "
                              f"processes; set trainer.fsdp_shard_size to a divisor of {world_size}")
    if shard == world_size:
        raise FSDPConfigError(f"trainer.fsdp_sharding=hybrid: {where} = {shard} is every process (one node): nothing "
                              f"to replicate; use trainer.fsdp_sharding=full, or trainer.fsdp_shard_size=N < "
                              f"{world_size} to shard over groups of N")
    if shard == 1:
        raise FSDPConfigError(f"trainer.fsdp_sharding=hybrid: {where} = 1 shards nothing (every process holds the "
                              f"whole model): use DDP (conf/accelerate/ddp.yaml), or trainer.fsdp_shard_size=N > 1")
    return world_size // shard, shard


def parallelism_config(tr, use_cpu: bool):
    """accelerate's ParallelismConfig for trainer.fsdp_sharding=hybrid under an FSDP launch (a 2-D mesh: replicate
    over dim 0, shard over dim 1; accelerate hands fully_shard that mesh); None for full sharding. Raises
    FSDPConfigError for hybrid outside an FSDP launch or a split that hybrid_sizes refuses."""
    if (tr.get("fsdp_sharding") or "full") != "hybrid":
        return None
    if use_cpu or not fsdp_launch():
        raise FSDPConfigError("trainer.fsdp_sharding=hybrid needs an FSDP launch on GPUs (accelerate launch "
                              "--config_file conf/accelerate/fsdp.yaml ...); under DDP or one process there is "
                              "nothing to shard: drop it (trainer.fsdp_sharding=full)")
    from accelerate.parallelism_config import ParallelismConfig

    local = os.environ.get("LOCAL_WORLD_SIZE")
    replicas, shard = hybrid_sizes(int(os.environ.get("WORLD_SIZE", "1")), tr.get("fsdp_shard_size"),
                                   int(local) if local else None)
    return ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shard)


def set_prefetch(model: torch.nn.Module, forward: int, backward: int) -> int:
    """Make each FSDP-wrapped Block of model issue the all-gathers of the next `forward` blocks when its own forward
    starts, and of the previous `backward` blocks when its backward starts; return the number of blocks set.

    forward=0 and backward=1 are FSDP2's defaults (a block's parameters are gathered when its forward starts, which
    the GPU overlaps with the block before as long as the host runs ahead; backward gathers one block ahead) and
    set nothing. More blocks ahead hide a slow all-gather behind more compute, at the memory of the gathered
    parameters of those blocks (docs/distributed.md)."""
    if forward == 0 and backward == 1:
        return 0
    from torch.distributed.fsdp import FSDPModule

    from models.blocks import Block

    blocks = [m for m in model.modules() if isinstance(m, Block) and isinstance(m, FSDPModule)]
    for i, block in enumerate(blocks):
        if forward:
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + forward])
        if backward != 1:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward):i][::-1])
    return len(blocks)
