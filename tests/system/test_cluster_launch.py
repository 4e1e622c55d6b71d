"""Four processes started the way ``srun`` starts them (the ``SLURM_*`` variables of two nodes with
two tasks each, on 127.0.0.1) and the way ``torchrun`` does form the same 2x2 mesh, with each
shard group on one node and each replica group across the two, and train to the same weights
(``docs/cluster.md``). The children start without a process group: Lightning makes it from the
variables, as on a cluster."""

from __future__ import annotations

import os
import random
import socket

import lightning.pytorch as pl

from lightning_twod import TwoDSparseStrategy
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
STEPS = 3


def _slurm(rank: int, port: int) -> dict[str, str]:
    """What ``srun --nodes=2 --ntasks-per-node=2`` gives task ``rank``; SLURM's job id sets Lightning's port."""
    return {"SLURM_NTASKS": str(WORLD), "SLURM_NTASKS_PER_NODE": str(PER_NODE), "SLURM_NNODES": str(NODES),
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % PER_NODE), "SLURM_NODEID": str(rank // PER_NODE),
            "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "twod-test", "SLURM_JOB_ID": f"9{port - 15000:04d}"}


def _torchrun(rank: int, port: int) -> dict[str, str]:
    """What ``torchrun --nnodes 2 --nproc-per-node 2`` gives worker ``rank``."""
    return {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank % PER_NODE),
            "LOCAL_WORLD_SIZE": str(PER_NODE), "GROUP_RANK": str(rank // PER_NODE), "NODE_RANK": str(rank // PER_NODE),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "twod-test"}


def _worker(rank: int, world: int, launcher: str, port: int) -> dict:
    for name in [n for n in os.environ if n.startswith("SLURM_")] + ["RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "MASTER_ADDR", "MASTER_PORT"]:
        os.environ.pop(name, None)
    os.environ.update((_slurm if launcher == "srun" else _torchrun)(rank, port))
    lit = C.LitDLRM(C.make_net("collection"), 0.2, num_samples=STEPS * world * C.LOCAL_BATCH)
    strategy = TwoDSparseStrategy(shard_group_size=PER_NODE, placement="contiguous", sparse_optimizer="sgd",
                                  sparse_lr=0.2)
    trainer = pl.Trainer(devices=PER_NODE, num_nodes=NODES, strategy=strategy, **C.trainer_kwargs(STEPS))
    trainer.fit(lit)
    groups = strategy.mesh_groups
    return {"environment": type(strategy.cluster_environment).__name__, "rank": trainer.global_rank,
            "node": trainer.node_rank, "shard": groups.shard_ranks, "replica": groups.replica_ranks,
            "steps": trainer.global_step, "state": C.numpy_state(lit.net.state_dict())}


def _slurm_port() -> int:
    """A free port that a SLURM job id can name (Lightning listens on 15000 + the id's last four digits)."""
    for port in random.sample(range(15000, 25000), 500):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 15000 and 24999")


def _launch(launcher: str) -> list[dict]:
    port = _slurm_port() if launcher == "srun" else C.free_port()
    return run_distributed(_worker, WORLD, launcher, port, timeout=300, init_group=False)


def test_srun_and_torchrun_form_the_same_node_local_mesh_and_train_alike():
    runs = {launcher: _launch(launcher) for launcher in ("srun", "torchrun")}
    assert {r["environment"] for r in runs["srun"]} == {"SLURMEnvironment"}
    assert {r["environment"] for r in runs["torchrun"]} == {"TorchElasticEnvironment"}
    for launcher, results in runs.items():
        for rank, result in enumerate(results):
            assert result["rank"] == rank and result["node"] == rank // PER_NODE, launcher
            assert {r // PER_NODE for r in result["shard"]} == {result["node"]}, "a shard group stays on its node"
            assert {r // PER_NODE for r in result["replica"]} == set(range(NODES)), "a replica group spans the nodes"
            assert result["steps"] == STEPS
    assert [r["shard"] for r in runs["srun"]] == [r["shard"] for r in runs["torchrun"]]
    for got, want in zip(runs["srun"], runs["torchrun"], strict=True):
        for key, value in want["state"].items():
            assert (got["state"][key] == value).all(), f"rank {got['rank']}: {key} differs"


def test_the_slurm_example_parses():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script, config = root / "examples" / "slurm" / "train.sbatch", root / "examples" / "slurm" / "synthetic_criteo_2x8.yaml"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=60).returncode == 0
    # the overrides the script passes, on the config it runs (printed, nothing instantiated: no GPU needed)
    done = subprocess.run([sys.executable, "-m", "lightning_twod", "fit", "--config", str(config),
                           "--trainer.num_nodes", "4", "--trainer.devices", "8",
                           "--trainer.strategy.init_args.links", "build/links.yaml", "--print_config"],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "num_nodes: 4" in done.stdout and "links: build/links.yaml" in done.stdout
    assert "save_last: true" in done.stdout and "dirpath: checkpoints/slurm_criteo" in done.stdout
    # and it builds: model, data, callbacks and strategy, planned for 2 nodes of 2 on small tables (no GPU here)
    small = "[" + ", ".join(["50"] * 26) + "]"
    planned = subprocess.run([sys.executable, "-m", "lightning_twod", "plan", "--config", str(config),
                              "--trainer.accelerator", "cpu", "--trainer.num_nodes", "2", "--trainer.devices", "2",
                              "--trainer.strategy.init_args.shard_group_size", "2", "--data.init_args.table_rows", small,
                              "--data.init_args.num_train", "4096", "--data.init_args.num_val", "1024"],
                             capture_output=True, text=True, timeout=300, cwd=root)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "TwoDSparseStrategy: shard_group_size=2, placement=contiguous (2 replica group(s) x 2 rank(s))" in planned.stdout
