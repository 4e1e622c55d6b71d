"""``python -m lightning_twod fit|validate|test|predict``: LightningCLI for any LightningModule.

Model and data are given by ``class_path`` (plus ``init_args``), the strategy by name
(``--trainer.strategy=twod_sparse``) or by ``class_path: lightning_twod.TwoDSparseStrategy`` with
typed ``init_args`` that the CLI validates. Example: ``examples/configs/synthetic_2x2.yaml``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_twod  # noqa: F401  (registers the strategy names before the arguments are parsed)


def main(argv: list[str] | None = None) -> LightningCLI:
    return LightningCLI(
        pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
        args=argv, save_config_kwargs={"overwrite": True},
    )
