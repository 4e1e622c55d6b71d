"""A distributed checkpoint (a directory) outside the 2D strategy.

* ``lightning_twod.checkpoint.load_from_checkpoint(Model, DIR)`` and the bundled ``DLRM.load_from_checkpoint(DIR)``
  give the LightningModule with the trained values, on one process;
* ``validate --ckpt_path DIR`` of a config without the 2D strategy is one error that names both fixes,
  and the file ``consolidate --lightning`` writes is a ``ckpt_path`` such a config reads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.checkpoint import load_from_checkpoint
from lightning_twod.datasets import SyntheticDataModule
from lightning_twod.models import DLRM
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
ROWS = [50] * 8  # the tables of examples/configs/synthetic_2x2.yaml's model, smaller
STEPS = 3


def _train(rank: int, world: int, port: int, path: str) -> dict:
    C.as_external_rank(rank, world, port)
    torch.manual_seed(0)
    model = DLRM(table_rows=ROWS, embedding_dim=16, lr=0.003)
    data = SyntheticDataModule(table_rows=ROWS, num_train=STEPS * WORLD * 16, num_val=64, batch_size=16)
    trainer = pl.Trainer(devices=WORLD, strategy=TwoDSparseStrategy(shard_group_size=2, sparse_lr=0.05),
                         **C.trainer_kwargs(STEPS))
    trainer.fit(model, data)
    trainer.save_checkpoint(path)
    return C.numpy_state(model.state_dict())  # the full tables: a collective on every rank


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("directory") / "trained.ckpt"
    return path, run_distributed(_train, WORLD, C.free_port(), str(path), timeout=300, init_group=False)[0]


def _assert_trained(model: DLRM, state: dict) -> None:
    got = model.state_dict()
    assert set(got) == set(state)
    for key, value in state.items():
        assert torch.equal(got[key], torch.from_numpy(value)), key


def test_one_call_gives_the_trained_module(trained):
    path, state = trained
    model = load_from_checkpoint(DLRM, path)
    assert isinstance(model, DLRM) and list(model.hparams["table_rows"]) == ROWS
    _assert_trained(model, state)
    _assert_trained(DLRM.load_from_checkpoint(path), state)
    _assert_trained(DLRM.load_from_checkpoint(str(path), lr=0.5), state)  # hyper-parameters overridden as Lightning does
    assert DLRM.load_from_checkpoint(str(path), lr=0.5).hparams["lr"] == 0.5


def _cli(command: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``command`` on examples/configs/synthetic_2x2.yaml with smaller tables and data, on one process."""
    rows = "[" + ", ".join(map(str, ROWS)) + "]"
    return subprocess.run([sys.executable, "-m", "lightning_twod", command,
                           "--config", str(ROOT / "examples" / "configs" / "synthetic_2x2.yaml"),
                           "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.limit_val_batches", "2",
                           "--data.init_args.table_rows", rows, "--data.init_args.num_train", "256",
                           "--data.init_args.num_val", "64", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_a_directory_without_the_strategy_is_one_error_naming_both_fixes(tmp_path):
    trained = _cli("fit", tmp_path, "--trainer.strategy.init_args.shard_group_size", "1", "--trainer.max_steps", "2",
                   "--trainer.val_check_interval", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    path = tmp_path / "checkpoints" / "synthetic_2x2" / "last.ckpt"
    assert path.is_dir()
    done = _cli("validate", tmp_path, "--trainer.strategy", "auto", "--ckpt_path", str(path))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "IsADirectoryError" not in done.stderr
    error = [line for line in done.stderr.splitlines() if "error:" in line]
    assert error == [f"lightning-twod validate: error: {path} is a distributed checkpoint (a directory that "
                     "TwoDSparseStrategy wrote, each rank its shards); only the 2D strategies read it. Run with the "
                     "2D strategy (trainer.strategy: twod_sparse, any mesh), or export it once: `lightning-twod "
                     f"consolidate {path} model.ckpt --lightning` writes a single-file checkpoint for any Trainer "
                     "and Model.load_from_checkpoint (in Python, in one call: "
                     "lightning_twod.checkpoint.load_from_checkpoint(Model, path))"]
    exported = subprocess.run([sys.executable, "-m", "lightning_twod", "consolidate", str(path), "model.ckpt",
                               "--lightning"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    done = _cli("validate", tmp_path, "--trainer.strategy", "auto", "--ckpt_path", "model.ckpt")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "val_auc" in done.stdout
    model = load_from_checkpoint(DLRM, path)  # the CLI's hyper-parameters name the class
    assert isinstance(model, DLRM) and list(model.hparams["table_rows"]) == ROWS
