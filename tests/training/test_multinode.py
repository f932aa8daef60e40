"""A multi-node launch (docs/distributed.md) as two "nodes" of one CPU process each on this machine, over gloo with a
localhost rendezvous: `accelerate launch --num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1 ...` and
its torchrun equivalent (`--nnodes 2 --node_rank 0|1 --master_addr ...`) train like one process at the same global
batch. data.shard=rows gives both runs the same global batches; the row hashes show that the two nodes' ranks
read different halves of each one (ranks that saw the same rows would also change the losses). The SLURM script
(scripts/slurm_train.sbatch) is checked to launch each node with the same accelerate command."""
import os
import socket
import subprocess
import sys

import pytest

from tests.training.helpers import REPO, SMALL, metrics

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
STEPS = 3
COMMON = [*SMALL, f"trainer.max_steps={STEPS}", "trainer.val_every=0", "trainer.save_final=false", "data.shard=rows",
          "trainer.data_hashes=true"]


def _losses(run_dir):
    return [r["train/loss"] for r in metrics(run_dir) if "train/loss" in r]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_command(launcher: str, rank: int, port: int) -> list[str]:
    """What a user runs on node `rank` of two (one process per node here; GPUs: one per GPU)."""
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu.yaml",
                "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(port), "--num_processes", "2"]  # the total over the machines
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "--nproc_per_node", "1"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, 4 rows a step (run once for every launcher's test)."""
    run_dir = tmp_path_factory.mktemp("one")
    one = subprocess.run([sys.executable, "train.py", *COMMON, "trainer.batch_size=4", f"hydra.run.dir={run_dir}"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert one.returncode == 0, one.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_two_nodes_match_one_process_at_the_same_global_batch(tmp_path, one_process, launcher):
    from training.data_hashes import cross_rank_overlap, read_hashes

    port, run_dir = _free_port(), tmp_path / "two_nodes"
    nodes = [subprocess.Popen([*_node_command(launcher, rank, port), "train.py", *COMMON, "trainer.device=cpu",
                               "trainer.batch_size=2", f"hydra.run.dir={run_dir}"], cwd=REPO, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    assert "2 process(es)" in outputs[0]  # one world of two ranks, not two one-process runs
    a, b = _losses(one_process), _losses(run_dir)
    assert len(a) == len(b) == STEPS
    assert b == pytest.approx(a, abs=1e-4), (a, b)
    assert a[-1] < a[0]
    # each node's rank trained on its own half of every global batch, and together on the one process's rows
    hashes = read_hashes(run_dir)
    assert cross_rank_overlap(hashes) == {"rows": {0: 2 * STEPS, 1: 2 * STEPS},
                                          "distinct": {0: 2 * STEPS, 1: 2 * STEPS}, "shared": 0}
    one_rows = [h for r in read_hashes(one_process)[0] for h in r["rows"]]
    assert sorted(one_rows) == sorted(h for recs in hashes.values() for r in recs for h in r["rows"])


def test_the_slurm_script_launches_each_node_as_the_accelerate_test_does(tmp_path):
    """scripts/slurm_train.sbatch under stand-ins for srun (one task per node, SLURM_NODEID 0 and 1) and scontrol
    (the allocation's hosts): each node runs the accelerate command above, rank and rendezvous filled in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shims = {"srun": 'while [[ $1 == --* ]]; do shift; done\nfor id in 0 1; do SLURM_NODEID=$id "$@"; done\n',
             # a large allocation's host list: a reader that stops at the first line must not fail the script
             "scontrol": 'echo 127.0.0.1\nseq -f "node-%g" 100000\n',
             "python": f'printf "%s\\n" "$@" > {tmp_path}/node$SLURM_NODEID.args\n'}
    for name, body in shims.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="127.0.0.1,node-b", GPUS_PER_NODE="1", MAIN_PORT="29611",
               ACCELERATE_CONFIG="conf/accelerate/cpu.yaml", PYTHON=str(bin_dir / "python"))
    overrides = ["trainer.device=cpu", "name=two nodes"]  # an argument with a space stays one argument
    out = subprocess.run(["bash", "scripts/slurm_train.sbatch", *overrides], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "2 nodes x 1 GPUs, rendezvous 127.0.0.1:29611" in out.stdout
    for rank in range(2):
        args = (tmp_path / f"node{rank}.args").read_text().splitlines()
        assert args == [*_node_command("accelerate", rank, 29611)[1:], "train.py", *overrides]


def test_the_scaling_script_plans_the_gpu_runs_at_one_global_batch(tmp_path):
    """scripts/scaling_runs.sh (docs/distributed.md) with DRY_RUN=1: every run at the global batch of 8 rows, the
    resumed runs from the saving run's middle checkpoint."""
    import shlex

    def plan(**env):
        out = subprocess.run(["bash", "scripts/scaling_runs.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, DRY_RUN="1", GPUS="8", OUT=str(tmp_path), PYTHON="py", **env),
                             check=False)
        assert out.returncode == 0, out.stderr
        runs = {}
        for line in out.stdout.splitlines():
            args = shlex.split(line)
            overrides = dict(a.split("=", 1) for a in args[args.index("train.py") + 1:])
            procs = int(args[args.index("--num_processes") + 1]) if "--num_processes" in args else 1
            runs[overrides["name"]] = (procs, args[args.index("--config_file") + 1] if procs > 1 else None, overrides)
        return runs

    runs = plan()
    assert list(runs) == ["1gpu-a", "1gpu-b", "ddp8", "fsdp8", "fsdp8-param_bf16", "fsdp8-prefetch1",
                          "fsdp8-prefetch2", "fsdp8-reduce_bf16", "fsdp8-save", "fsdp4-resumed", "1gpu-resumed"]
    for name, (procs, config, o) in runs.items():
        assert procs * int(o["trainer.batch_size"]) * int(o.get("trainer.grad_accum", 1)) == 8, name
        assert o["data.shard"] == "rows" and o["hydra.run.dir"] == f"{tmp_path}/{name}"
        assert config == (None if procs == 1 else "conf/accelerate/ddp.yaml" if name.startswith("ddp")
                          else "conf/accelerate/fsdp.yaml"), name
    assert runs["fsdp8-save"][2]["trainer.save_every"] == "25"
    for name in ("fsdp4-resumed", "1gpu-resumed"):
        assert runs[name][2]["trainer.resume"] == f"{tmp_path}/fsdp8-save/checkpoints/step_00000025"
    assert runs["fsdp8-reduce_bf16"][2]["trainer.fsdp_reduce_dtype"] == "bf16"
    assert list(plan(SKIP_ONE_GPU="1", EXTRA="trainer.gradient_checkpointing=true")) == [
        n for n in runs if not n.startswith(("1gpu", "ddp"))]
    assert all(o["trainer.gradient_checkpointing"] == "true"
               for _, _, o in plan(EXTRA="trainer.gradient_checkpointing=true").values())
