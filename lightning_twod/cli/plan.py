"""``lightning-twod plan --config X.yaml [overrides]``: the plan ``fit`` will log, and 1D beside it.

``plan`` parses the same config and overrides as ``fit`` (``cli.fit``'s LightningCLI), builds the
same model, data and strategy, and prints the plan ``fit`` logs at set-up, on the links ``fit``
plans on, without training; where the chosen layout is not 1D, each rank's memory and predicted
load under 1D beside it. Where ``fit`` reads the links cache, ``plan`` reads the same entry; where
``fit`` would measure, ``plan`` measures here first, on processes it starts and ends (and says so
before), and keeps what it measured in the cache for the ``fit`` that follows; else it starts none.
Where ``fit`` estimates lookup statistics from the first training batch, ``plan`` sets up the data as
``fit`` does (``prepare_data``, ``setup("fit")``) and estimates them from the same batch.
"""

from __future__ import annotations

import math
import socket
import warnings
from collections.abc import Sequence
from typing import Any

import yaml

from lightning_twod.cli.fit import TwoDCLI
from lightning_twod.core.mesh import SparseParallelDims
from lightning_twod.hardware.probe import measure_here
from lightning_twod.hardware.resolve import configured_links, device_name, measures, unmeasured_links
from lightning_twod.planner import link_cache
from lightning_twod.planner.evaluate import TableRow, format_table_rows
from lightning_twod.planner.link_cache import CacheKey
from lightning_twod.planner.plan import ShardingPlan, format_gib
from lightning_twod.sparse.kernels import fbgemm_available
from lightning_twod.strategies.engine import TwoDSparseEngine


def plan_main(argv: Sequence[str]) -> int:
    """``lightning-twod plan --config X.yaml [overrides]``: the plan ``fit`` will log, and 1D beside it."""
    cli = TwoDCLI(argv, run=False, prog="lightning-twod plan", extra_arguments=[
        ("--save", {"type": str, "help": "write the chosen plan as YAML here (pin it with the strategy's plan=)"}),
        ("--links", {"type": str, "help": "what to predict on: auto (as fit: the links cache, else measure this "
                                          "machine), measure (measure here and refresh the cache), a file of "
                                          "`lightning-twod calibrate`, or a preset; default: what fit uses (the "
                                          "strategy's links=)"}),
        ("--output", {"type": str, "help": "write what is printed per table (type, group, copies, ranks, bytes, "
                                           "ms) and the layout as YAML here"}),
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
    if strategy.samples_lookup_stats and cli.datamodule is not None:  # as fit, before set-up samples the first batch
        cli.datamodule.prepare_data()
        cli.datamodule.setup("fit")
    planned = strategy.plan_layout(cli.model, budget, links, cli.datamodule)
    backend, why = strategy.backend_for(planned, fbgemm_available())
    print(f"{name}: {planned.explanation}")
    print(f"kernel backend: {backend} ({why})")
    print(f"sparse optimizer: {strategy.options.optimizer_settings.describe()}")
    if strategy.options.sparse_per_table:
        print(strategy.table_optimizer_summary())
    print(planned.plan.describe())
    rows = strategy.table_rows(cli.model, planned.plan, links, cli.datamodule)
    print("\nper table (memory: the most a rank holding it allocates for it; ms: the most it adds to such a "
          "rank's predicted step)")
    print(format_table_rows(rows))
    if planned.plan.per_table:
        print("\nper-rank memory of a per-table layout: the sum over its group sizes (the busiest rank above); "
              "the 1D comparison is for layouts of one group size")
    elif planned.group_size != strategy.world_size and strategy.options.plan is None:
        one_d = strategy.plan_layout(cli.model, math.inf, links, cli.datamodule,
                                     shard_group_size=strategy.world_size, placement="contiguous", own_sizes=False)
        print()
        print(side_by_side(planned.plan, one_d.plan, budget))
    if cli.config.get("output"):
        write_output(cli.config["output"], planned, rows, f"{name}: {planned.explanation.splitlines()[0]}")
        print(f"per-table report written to {cli.config['output']}")
    if cli.config.get("save"):
        planned.plan.save(cli.config["save"])
        print(f"plan written to {cli.config['save']}")
    return 0


def write_output(path: str, planned: Any, rows: Sequence[TableRow], decision: str) -> None:
    """``plan``'s report as YAML: the layout (and why), then one entry per table (``TableRow.to_dict``)."""
    plan = planned.plan
    report = {"world_size": plan.world_size, "shard_group_size": plan.shard_group_size, "placement": plan.placement,
              "group_sizes": plan.group_sizes(), "decision": decision, "tables": [row.to_dict() for row in rows]}
    with open(path, "w") as f:
        yaml.safe_dump(report, f, sort_keys=False, default_flow_style=None, width=120)


def _plan_links(strategy: Any, given: str | None) -> tuple[Any, str]:
    """The links ``plan`` predicts on, and a note on where they come from (or ``""``).

    By default what ``fit`` plans on: its configured links, or, where fit reads the links cache and
    measures on a miss (``links="auto"``, a layout chosen by cost), the cache's entry for fit's job
    (``link_cache``: this host, for a job of one node; for several nodes, whose hosts ``plan`` does not
    know, the newest entry of the same shape), else the same probe run here on one node's ranks
    (``probe.measure_here``), kept in the cache where the job is this one node, so that ``fit`` plans
    on the same numbers. ``given``: ``--links`` (``auto`` as fit does; ``measure`` measures here).
    """
    configured = strategy.options.links if given is None else configured_links(given, "--links")
    if given not in ("auto", "measure") and not measures(configured, strategy.layout_by_cost):
        return (configured if not isinstance(configured, str) else unmeasured_links(strategy.root_device)), ""
    local, one_node = strategy.num_processes, strategy.world_size == strategy.num_processes
    key = CacheKey((socket.gethostname(),), strategy.world_size, local, device_name(strategy.root_device))
    if configured == "auto":
        found = link_cache.load(key) if one_node else link_cache.newest(key)
        if found.corrupt:
            warnings.warn(f"{found.note}: measuring the links again", stacklevel=2)
        if found.links is not None:
            return found.links, (f"links {found.note}: fit plans on the same numbers on these hosts"
                                 + ("" if found.key == key else " (hosts of an earlier job of this shape)"))
    if local < 2:
        return unmeasured_links(strategy.root_device), (
            "fit measures the links across its nodes at set-up; one rank per node here has no links to measure: "
            "run `lightning-twod calibrate` on the cluster (it keeps them in the links cache) or plan on --links FILE")
    why = ("as --links measure asks" if given == "measure" else "as fit does at set-up with links='measure'"
           if configured == "measure" else f"as fit does at set-up with links='auto' and a layout chosen by cost: "
                                           f"{found.note}")
    print(f"measuring the links on {local} processes started here, {why} (--links FILE from `lightning-twod "
          "calibrate`, or a preset, plans without starting processes) ...", flush=True)
    links = measure_here(local, strategy.root_device.type, local)
    if not one_node:
        return links, (f"measured here on {local} processes (one node); the links across nodes were not measured and "
                       "are taken as the ones inside: run `lightning-twod calibrate` under torchrun on every node "
                       "(it keeps them in the links cache) for what fit measures there")
    try:
        kept = f"kept in the links cache {link_cache.save(key, links)}: fit on this machine plans on the same numbers"
    except (OSError, RuntimeError) as err:
        kept = f"not kept, the links cache cannot be written ({err})"
    return links, f"measured here on {local} processes, as fit does at set-up; {kept}"


def side_by_side(two_d: ShardingPlan, one_d: ShardingPlan, memory: float, max_rows: int = 16) -> str:
    """Per global rank: memory and predicted load under 1D and under the chosen 2D layout."""
    dims = SparseParallelDims(two_d.world_size, two_d.shard_group_size, two_d.placement)
    lines = [f"per-rank memory and predicted load, 1D (1 x {one_d.world_size}) vs 2D "
             f"({two_d.num_replicas} x {two_d.shard_group_size}); a rank has {format_gib(memory)}",
             f"  {'rank':>4}  {'1D memory':>11}  {'1D load ms':>10}  {'2D memory':>11}  {'2D load ms':>10}"]
    ranks = range(two_d.world_size)
    for rank in list(ranks)[:max_rows]:
        a = one_d.report.ranks[rank]
        b = two_d.report.ranks[dims.shard_rank(rank)]
        lines.append(f"  {rank:>4}  {format_gib(a.memory):>11}  {a.load.total * 1e3:>10.3f}  {format_gib(b.memory):>11}  "
                     f"{b.load.total * 1e3:>10.3f}")
    if two_d.world_size > max_rows:
        lines.append(f"  ... {two_d.world_size - max_rows} more ranks")
    lines.append(f"  {'max':>4}  {format_gib(one_d.report.max_memory):>11}  {one_d.report.max_load * 1e3:>10.3f}  "
                 f"{format_gib(two_d.report.max_memory):>11}  {two_d.report.max_load * 1e3:>10.3f}")
    lines.append(f"  imbalance (max/mean load): 1D {one_d.report.imbalance:.2f}, 2D {two_d.report.imbalance:.2f}")
    return "\n".join(lines)
