"""Where the CLI writes the run's resolved ``config.yaml``: in the logger's folder; without a logger,
beside the checkpoints (never over another config), else nowhere; never into the working folder.
One-process fits in this process (no strategy: where the file goes does not depend on it)."""

from __future__ import annotations

import pytest
import yaml

from lightning_twod.cli.fit import main
from tests.helpers.cli_cases import write_config

ONE_PROCESS = ["--trainer.devices=1", "--trainer.strategy=auto", "--trainer.max_steps=1"]
MINE = "this file is the user's\n"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The working folder of the run, holding the user's own ``config.yaml``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(MINE)
    return tmp_path


def _fit(folder, *overrides: str) -> None:
    main(["fit", "--config", str(write_config(folder)), *ONE_PROCESS, *overrides])


def _written(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("config*.yaml")} - {"config.yaml"}


def test_without_a_logger_the_config_goes_beside_the_checkpoints(folder):
    _fit(folder, "--trainer.logger=false", "--trainer.enable_checkpointing=true")
    assert (folder / "config.yaml").read_text() == MINE
    assert _written(folder) == {"checkpoints/config.yaml"}
    saved = yaml.safe_load((folder / "checkpoints" / "config.yaml").read_text())
    assert saved["model"]["class_path"] == "lightning_twod.models.dlrm.DLRM" and saved["trainer"]["max_steps"] == 1
    assert list((folder / "checkpoints").glob("*.ckpt")), "the checkpoint it belongs to"
    first = (folder / "checkpoints" / "config.yaml").read_text()
    _fit(folder, "--trainer.logger=false", "--trainer.enable_checkpointing=true", "--trainer.max_steps=2")
    assert _written(folder) == {"checkpoints/config.yaml", "checkpoints/config-v1.yaml"}
    assert (folder / "checkpoints" / "config.yaml").read_text() == first
    assert yaml.safe_load((folder / "checkpoints" / "config-v1.yaml").read_text())["trainer"]["max_steps"] == 2


def test_without_a_logger_or_checkpoints_no_config_is_written(folder):
    _fit(folder, "--trainer.logger=false", "--trainer.enable_checkpointing=false")
    assert (folder / "config.yaml").read_text() == MINE
    assert _written(folder) == set()


def test_with_a_logger_the_config_goes_into_its_folder(folder):
    _fit(folder, "--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir=logs",
         "--trainer.enable_checkpointing=false")
    assert (folder / "config.yaml").read_text() == MINE
    assert _written(folder) == {"logs/lightning_logs/version_0/config.yaml"}
