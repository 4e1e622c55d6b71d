"""``lightning-twod fit|validate|test|predict``: one LightningCLI parser for any LightningModule.

Model and data are given by ``class_path`` (plus ``init_args``), the strategy by name
(``--trainer.strategy=twod_sparse``) or by ``class_path: lightning_twod.TwoDSparseStrategy`` with
typed ``init_args`` that the CLI validates. Example: ``examples/configs/synthetic_2x2.yaml``.

The data's ``table_rows`` and ``num_dense`` are linked into the model's arguments of the same
names (where both have them), so a config states them once, under ``data``. ``plan`` (``cli.plan``)
parses with the same class.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import lightning_twod  # noqa: F401  (registers the strategy names before the arguments are parsed)
from lightning_twod.strategies.quiet import quiet_lightning

#: Attributes of the datamodule that become the model's ``init_args`` of the same name.
LINKED_FROM_DATA = ("table_rows", "num_dense")


quiet_lightning()  # nothing the user cannot act on, whatever the strategy (strategies/quiet.py)


class TwoDCLI(LightningCLI):
    """LightningCLI with the data's table sizes linked into the model and ``prog`` ``lightning-twod``.

    ``args``: the command line after the program name (``["fit", "--config", ...]``), or after
    ``plan`` with ``run=False``. Unlike LightningCLI it never warns that ``args`` and ``sys.argv``
    are both given: the entry point always passes the arguments itself.
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True, prog: str = "lightning-twod",
                 extra_arguments: Sequence[tuple[str, dict[str, Any]]] = ()) -> None:
        self._extra_arguments = list(extra_arguments)
        super().__init__(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                         subclass_mode_data=True, args=list(args or []), run=run,
                         parser_kwargs={"prog": prog}, save_config_callback=SaveRunConfig,
                         save_config_kwargs={"overwrite": True})

    def add_arguments_to_parser(self, parser) -> None:
        for name in LINKED_FROM_DATA:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        for flag, options in self._extra_arguments:
            parser.add_argument(flag, **options)

    def parse_arguments(self, parser, args) -> None:
        self.config = parser.parse_args(args)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        config = self.config.get(str(self.subcommand), self.config)
        check_linked_values(config["model"], self.model, self.datamodule)


class SaveRunConfig(SaveConfigCallback):
    """The run's resolved config as ``config.yaml``: in the logger's folder (Lightning's
    ``SaveConfigCallback``); without a logger, beside the checkpoints of ``fit``, as
    ``config-vN.yaml`` where a config is there already; nowhere without either. Never into the
    working folder, where Lightning's ``trainer.log_dir`` points without a logger."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.loggers:
            super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checkpoint = trainer.checkpoint_callback  # its folder is resolved once the callbacks' setup has run
        if trainer.loggers or self.already_saved or checkpoint is None or not trainer.is_global_zero:
            return
        folder, (stem, suffix) = checkpoint.dirpath, os.path.splitext(self.config_filename)
        fs = get_filesystem(folder)
        fs.makedirs(folder, exist_ok=True)
        path, version = os.path.join(folder, self.config_filename), 0
        while fs.exists(path):
            version += 1
            path = os.path.join(folder, f"{stem}-v{version}{suffix}")
        self.parser.save(self.config, path, skip_none=False, multifile=self.multifile)
        self.already_saved = True


def check_linked_values(model_config: Mapping[str, Any], model: Any, datamodule: Any) -> None:
    """Raise ``MisconfigurationException`` where the config gave the model a ``LINKED_FROM_DATA`` value (not its
    default) that differs from the data's: the link would have replaced it without a word."""
    parameters = inspect.signature(type(model).__init__).parameters
    given = model_config.get("init_args") or {}
    for name in LINKED_FROM_DATA:
        if name not in parameters or not hasattr(datamodule, name) or given.get(name) is None:
            continue
        value, default, linked = given[name], parameters[name].default, getattr(datamodule, name)
        if _same(value, default) or _same(value, linked):
            continue
        raise MisconfigurationException(
            f"model.init_args.{name}={_plain(value)} disagrees with the data's {name}={_plain(linked)} "
            f"({type(datamodule).__name__}): the CLI takes the model's {name} from the data; remove "
            f"model.init_args.{name} from the config, or set data.init_args.{name}"
        )


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    return _plain(a) == _plain(b)


def main(argv: Sequence[str]) -> TwoDCLI:
    """``fit``, ``validate``, ``test`` or ``predict``: ``argv`` starts with the command."""
    return TwoDCLI(argv)
