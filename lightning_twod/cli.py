"""``lightning-twod fit|validate|test|predict|plan``: one LightningCLI parser for any LightningModule.

Model and data are given by ``class_path`` (plus ``init_args``), the strategy by name
(``--trainer.strategy=twod_sparse``) or by ``class_path: lightning_twod.TwoDSparseStrategy`` with
typed ``init_args`` that the CLI validates. Example: ``examples/configs/synthetic_2x2.yaml``.

The data's ``table_rows`` and ``num_dense`` are linked into the model's arguments of the same
names (where both have them), so a config states them once, under ``data``. ``plan`` parses the
same config and overrides as ``fit``, builds the same model, data and strategy, and prints the plan
``fit`` logs at set-up, without starting processes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_twod  # noqa: F401  (registers the strategy names before the arguments are parsed)

#: Attributes of the datamodule that become the model's ``init_args`` of the same name.
LINKED_FROM_DATA = ("table_rows", "num_dense")


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
                         parser_kwargs={"prog": prog}, save_config_kwargs={"overwrite": True})

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


def check_linked_values(model_config: Mapping[str, Any], model: Any, datamodule: Any) -> None:
    """Raise ``ValueError`` where the config gave the model a ``LINKED_FROM_DATA`` value (not its
    default) that differs from the data's: the link would have replaced it without a word."""
    parameters = inspect.signature(type(model).__init__).parameters
    given = model_config.get("init_args") or {}
    for name in LINKED_FROM_DATA:
        if name not in parameters or not hasattr(datamodule, name) or given.get(name) is None:
            continue
        value, default, linked = given[name], parameters[name].default, getattr(datamodule, name)
        if _same(value, default) or _same(value, linked):
            continue
        raise ValueError(
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


# ----------------------------------------------------------------------------- plan
def plan_main(argv: Sequence[str]) -> int:
    """``lightning-twod plan --config X.yaml [overrides]``: the plan ``fit`` will log, and 1D beside it."""
    from lightning_twod.engine import TwoDSparseEngine
    from lightning_twod.links import planning_links
    from lightning_twod.planner.commands import side_by_side
    from lightning_twod.sparse.kernels import fbgemm_available

    cli = TwoDCLI(argv, run=False, prog="lightning-twod plan", extra_arguments=[
        ("--save", {"type": str, "help": "write the chosen plan as YAML here (pin it with the strategy's plan=)"}),
    ])
    strategy = cli.trainer.strategy
    if not isinstance(strategy, TwoDSparseEngine):
        cli.parser.error(f"trainer.strategy is {type(strategy).__name__}: plan needs the 2D strategy "
                         "(--trainer.strategy=twod_sparse, or its class_path lightning_twod.TwoDSparseStrategy)")
    name = type(strategy).__name__
    budget = strategy.memory_budget()
    links = planning_links(strategy.links, None, strategy.num_processes, strategy.root_device,
                           strategy.layout_by_cost)
    planned = strategy.plan_layout(cli.model, budget, links, cli.datamodule)
    backend, why = strategy.backend_for(planned, fbgemm_available())
    if strategy.links in ("measure", "auto") and (strategy.links == "measure" or strategy.layout_by_cost):
        print(f"note: fit measures the links at set-up; this plan predicts on the {links.name} preset. Plan on "
              "measured numbers with --trainer.strategy.init_args.links=FILE (from `lightning-twod calibrate`)\n")
    print(f"{name}: {planned.explanation}")
    print(f"kernel backend: {backend} ({why})")
    print(planned.plan.describe())
    if planned.group_size != strategy.world_size and strategy.plan is None:
        one_d = strategy.plan_layout(cli.model, math.inf, links, cli.datamodule,
                                     shard_group_size=strategy.world_size, placement="contiguous")
        print()
        print(side_by_side(planned.plan, one_d.plan, budget))
    if cli.config.get("save"):
        planned.plan.save(cli.config["save"])
        print(f"plan written to {cli.config['save']}")
    return 0
