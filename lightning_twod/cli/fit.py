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
    from lightning_twod.integration.engine import TwoDSparseEngine
    from lightning_twod.cli.planning import side_by_side
    from lightning_twod.sparse.kernels import fbgemm_available

    cli = TwoDCLI(argv, run=False, prog="lightning-twod plan", extra_arguments=[
        ("--save", {"type": str, "help": "write the chosen plan as YAML here (pin it with the strategy's plan=)"}),
        ("--links", {"type": str, "help": "what to predict on: auto (measure this machine as fit does at set-up), "
                                          "a file of `lightning-twod calibrate`, or a preset; default: what fit "
                                          "uses (the strategy's links=, measured here where fit measures)"}),
    ])
    strategy = cli.trainer.strategy
    if not isinstance(strategy, TwoDSparseEngine):
        cli.parser.error(f"trainer.strategy is {type(strategy).__name__}: plan needs the 2D strategy "
                         "(--trainer.strategy=twod_sparse, or its class_path lightning_twod.TwoDSparseStrategy)")
    name = type(strategy).__name__
    budget = strategy.memory_budget()
    links, note = _plan_links(strategy, cli.config.get("links"))
    if note:
        print(f"note: {note}\n")
    planned = strategy.plan_layout(cli.model, budget, links, cli.datamodule)
    backend, why = strategy.backend_for(planned, fbgemm_available())
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


def _plan_links(strategy: Any, given: str | None) -> tuple[Any, str]:
    """The links ``plan`` predicts on, and a note on where they come from (or ``""``).

    By default what ``fit`` plans on: its configured links, or, where fit measures at set-up,
    the same probe run here on one node's ranks (``links.measure_here``), so that ``plan`` prints
    the layout ``fit`` chooses on this machine. ``given``: ``--links`` (``auto`` measures here).
    """
    from lightning_twod.cluster.links import configured_links, measure_here, measures, unmeasured_links

    configured = strategy.links if given is None else configured_links(given, "--links")
    if given != "auto" and not measures(configured, strategy.layout_by_cost):
        return (configured if not isinstance(configured, str) else unmeasured_links(strategy.root_device)), ""
    local = strategy.num_processes
    if local < 2:
        return unmeasured_links(strategy.root_device), (
            "fit measures the links across its nodes at set-up; one rank per node here has no links to measure: "
            "plan on --links FILE written by `lightning-twod calibrate` on the cluster")
    links = measure_here(local, strategy.root_device.type, local)
    if strategy.world_size > local:
        return links, (f"measured here on {local} processes (one node); the links across nodes were not measured and "
                       "are taken as the ones inside: plan on --links FILE written by `lightning-twod calibrate` "
                       "under torchrun on every node for what fit measures there")
    return links, f"measured here on {local} processes, as fit does at set-up (the layout is chosen within the probes' spread)"
