"""``python -m lightning_twod plan|simulate``: the planner's command-line tools.

``plan --config CONFIG`` reads a LightningCLI YAML config (model ``class_path``/``init_args``,
``trainer.devices``/``num_nodes``, the strategy's ``init_args``), builds the model unsharded to
find its tables, and prints the plan and the per-rank memory of 1D next to the chosen 2D layout.
``simulate`` predicts step time and scaling of 1D and 2D from 8 to 4,096 GPUs (``simulate.py``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_twod.planner.cost import GIB, TableSpec
from lightning_twod.planner.hardware import HARDWARE, H100
from lightning_twod.planner.layout import plan_for_strategy
from lightning_twod.planner.links import resolve_links
from lightning_twod.planner.plan import ShardingPlan, _gib
from lightning_twod.planner.planner import PlanError
from lightning_twod.planner.steptime import DenseModel


# ----------------------------------------------------------------------------- model tables
def tables_of_model(model) -> dict[str, list]:
    """``{attribute path: [EmbeddingTableConfig]}`` of every embedding module ``shard_model`` would swap."""
    from lightning_twod.sparse.wrap import embedding_tables

    return embedding_tables(model)


def _instantiate(spec: Mapping[str, Any]):
    module_name, _, cls_name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(**dict(spec.get("init_args") or {}))


def _read_config(path: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ----------------------------------------------------------------------------- plan
def plan_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_twod plan",
        description="Print the sharding plan of a LightningCLI config and the per-rank memory of 1D vs 2D.")
    parser.add_argument("--config", required=True, help="LightningCLI YAML (model, trainer, strategy)")
    parser.add_argument("--batch-size", type=int, help="samples per rank (default: data.init_args.batch_size)")
    parser.add_argument("--world-size", type=int, help="ranks (default: trainer.devices x trainer.num_nodes)")
    parser.add_argument("--memory-per-rank-gb", type=float,
                        help="GiB per rank for tables (default: the strategy's memory_per_rank_gb, else the "
                             "hardware's memory, or host memory / devices for accelerator: cpu)")
    parser.add_argument("--pooling-factor", type=float, default=1.0, help="ids per sample per feature")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default=H100.name,
                        help="machine whose memory is the default budget (GPU configs)")
    parser.add_argument("--links", help="a preset (h100, a100-p4d) or a file of `python -m lightning_twod calibrate` "
                                        "to predict the step on (default: the strategy's links, else --hardware)")
    parser.add_argument("--ranks-per-node", type=int, help="default: trainer.devices")
    parser.add_argument("--shard-group-size", help="auto or a number (default: the strategy's)")
    parser.add_argument("--placement", choices=("auto", "contiguous", "strided"), help="default: the strategy's")
    parser.add_argument("--sync-interval", type=int, help="default: the strategy's")
    parser.add_argument("--sync-overlap", action="store_true", help="default: the strategy's")
    parser.add_argument("--sync-dtype", choices=("fp32", "bf16"), help="default: the strategy's")
    parser.add_argument("--save", help="write the chosen plan as YAML here (pin it with the strategy)")
    args = parser.parse_args(argv)

    config = _read_config(args.config)
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy") or {}
    init = dict(strategy.get("init_args") or {}) if isinstance(strategy, Mapping) else {}
    devices = _int_or_none(trainer.get("devices"))
    nodes = _int_or_none(trainer.get("num_nodes")) or 1
    world = args.world_size or (devices * nodes if devices else None)
    if not world:
        parser.error(f"trainer.devices={trainer.get('devices')!r} is not a number; pass --world-size")
    per_node = args.ranks_per_node or min(world, devices or world)
    batch = args.batch_size or ((config.get("data") or {}).get("init_args") or {}).get("batch_size") or 512
    hardware = HARDWARE[args.hardware]
    if args.memory_per_rank_gb is not None:
        memory = args.memory_per_rank_gb * GIB
    elif init.get("memory_per_rank_gb") is not None:
        memory = float(init["memory_per_rank_gb"]) * GIB
    elif trainer.get("accelerator") == "cpu":
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / per_node
    else:
        memory = hardware.memory_bytes

    configured = init.get("links")
    links = resolve_links(args.links or (configured if configured not in (None, "auto", "measure") else hardware.name))
    model = _instantiate(config["model"])
    tables = tables_of_model(model)
    stats = {t.name: {"pooling_factor": args.pooling_factor} for ts in tables.values() for t in ts}
    common = dict(placement=args.placement or init.get("placement", "contiguous"),
                  optimizer=init.get("sparse_optimizer", "rowwise_adagrad").replace("momentum_", ""),
                  sync_interval=args.sync_interval or int(init.get("sync_interval", 1)),
                  sync_dtype=args.sync_dtype or init.get("sync_dtype", "fp32"),
                  sync_overlap=args.sync_overlap or bool(init.get("sync_overlap", False)),
                  comm_dtype=init.get("comm_dtype", "fp32"), stats=stats, links=links)
    table_params = sum(t.num_embeddings * t.embedding_dim for ts in tables.values() for t in ts)
    common["dense"] = DenseModel(max(0, sum(p.numel() for p in model.parameters()) - table_params))
    constraints = init.get("sharding") or {}
    group = args.shard_group_size or init.get("shard_group_size", "auto")
    if str(group) != "auto" and not str(group).isdigit():
        parser.error(f"--shard-group-size {group!r}: use auto or a number")
    group = group if str(group) == "auto" else int(group)
    try:
        result = plan_for_strategy(tables, world, per_node, batch, memory, constraints, group, **common)
    except ValueError as err:
        parser.error(str(err))
    print(result.explanation)
    print(result.plan)
    one_d = None
    if result.group_size != world:
        try:
            one_d = plan_for_strategy(tables, world, per_node, batch, math.inf, constraints, world,
                                      **{**common, "placement": "contiguous"}).plan
        except PlanError as err:  # pragma: no cover - an unlimited budget always fits
            print(f"1D: {err}")
    print()
    print(side_by_side(result.plan, one_d or result.plan, memory))
    if args.save:
        result.plan.save(args.save)
        print(f"plan written to {args.save}")
    return 0


def side_by_side(two_d: ShardingPlan, one_d: ShardingPlan, memory: float, max_rows: int = 16) -> str:
    """Per global rank: memory and predicted load under 1D and under the chosen 2D layout."""
    from lightning_twod.topology import SparseParallelDims

    dims = SparseParallelDims(two_d.world_size, two_d.shard_group_size, two_d.placement)
    lines = [f"per-rank memory and predicted load, 1D (1 x {one_d.world_size}) vs 2D "
             f"({two_d.num_replicas} x {two_d.shard_group_size}); a rank has {_gib(memory)}",
             f"  {'rank':>4}  {'1D memory':>11}  {'1D load ms':>10}  {'2D memory':>11}  {'2D load ms':>10}"]
    ranks = range(two_d.world_size)
    for rank in list(ranks)[:max_rows]:
        a = one_d.report.ranks[rank]
        b = two_d.report.ranks[dims.shard_rank(rank)]
        lines.append(f"  {rank:>4}  {_gib(a.memory):>11}  {a.load.total * 1e3:>10.3f}  {_gib(b.memory):>11}  "
                     f"{b.load.total * 1e3:>10.3f}")
    if two_d.world_size > max_rows:
        lines.append(f"  ... {two_d.world_size - max_rows} more ranks")
    lines.append(f"  {'max':>4}  {_gib(one_d.report.max_memory):>11}  {one_d.report.max_load * 1e3:>10.3f}  "
                 f"{_gib(two_d.report.max_memory):>11}  {two_d.report.max_load * 1e3:>10.3f}")
    lines.append(f"  imbalance (max/mean load): 1D {one_d.report.imbalance:.2f}, 2D {two_d.report.imbalance:.2f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- simulate
def _load_tables(path: str) -> list[TableSpec]:
    """Tables from YAML: a list of ``{name, rows, dim, features?, pooling_factor?, id_skew?, hashed?}``."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entries = data["tables"] if isinstance(data, dict) else data
    return [TableSpec(**entry) for entry in entries]


def simulate_main(argv: Sequence[str] | None = None) -> int:
    from lightning_twod.planner import simreport
    from lightning_twod.planner import simulate as sim

    parser = argparse.ArgumentParser(
        prog="python -m lightning_twod simulate",
        description="Predict step time and weak-scaling efficiency of 1D and of the best 2D layout (group size, "
                    "placement, reduction interval) at each world size.")
    parser.add_argument("--preset", choices=sorted(sim.PRESETS), default="paper",
                        help="starting scenario (every number below overrides it)")
    parser.add_argument("--tables", help="YAML list of tables {name, rows, dim, pooling_factor, ...}")
    parser.add_argument("--batch-size", type=int, help="samples per GPU")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--nodes", type=int, nargs="+", help="node counts to simulate (default: 1 .. 512)")
    parser.add_argument("--hardware", choices=sorted(HARDWARE))
    parser.add_argument("--links", help="a file written by `python -m lightning_twod calibrate` (default: the "
                                        "hardware's preset)")
    parser.add_argument("--intra-bw", type=float, help="GB/s per GPU inside a node (peak; the preset's efficiency applies)")
    parser.add_argument("--inter-bw", type=float, help="GB/s per GPU across nodes (peak)")
    parser.add_argument("--intra-latency-us", type=float, help="microseconds per intra-node collective")
    parser.add_argument("--inter-latency-us", type=float, help="microseconds per remote peer message")
    parser.add_argument("--memory-gb", type=float, help="GB of memory per GPU")
    parser.add_argument("--dense-params", type=float, help="dense (DDP) parameters")
    parser.add_argument("--dense-gflops", type=float, help="dense GFLOP per sample, forward + backward")
    parser.add_argument("--sync-interval", type=int, nargs="+", dest="sync_intervals",
                        help="candidate steps between cross-group reductions (default 1 4 16)")
    parser.add_argument("--overlap", action="store_true", help="overlap the reduction with the next interval")
    parser.add_argument("--sync-dtype", choices=("fp32", "bf16"), help="the reduction's wire type")
    parser.add_argument("--group-size", help="2D shard group: auto (the fastest that fits), node, or a number")
    parser.add_argument("--placement", choices=("auto", "contiguous", "strided"))
    parser.add_argument("--plot", help="also write the scaling plot here (PNG)")
    parser.add_argument("--memory", action="store_true", help="also print the busiest rank's memory by category")
    args = parser.parse_args(argv)

    scenario = sim.PRESETS[args.preset]
    changes: dict[str, Any] = {}
    if args.tables:
        changes["tables"] = tuple(_load_tables(args.tables))
        changes["name"] = Path(args.tables).stem
    if args.hardware:
        changes["hardware"] = HARDWARE[args.hardware]
    for field_name, value in (("batch_size", args.batch_size), ("gpus_per_node", args.gpus_per_node),
                              ("dense_params", args.dense_params), ("placement", args.placement)):
        if value is not None:
            changes[field_name] = value
    if args.sync_intervals:
        if min(args.sync_intervals) < 1:
            parser.error("--sync-interval: steps between reductions must be >= 1")
        changes["sync_intervals"] = tuple(sorted(set(args.sync_intervals)))
    if args.overlap:
        changes["sync_overlap"] = True
    if args.sync_dtype:
        changes["sync_bytes"] = 2 if args.sync_dtype == "bf16" else 4
    if args.dense_gflops is not None:
        changes["dense_flops_per_sample"] = args.dense_gflops * 1e9
    if args.group_size:
        if not (args.group_size.isdigit() and int(args.group_size) > 0) and args.group_size not in ("auto", "node"):
            parser.error(f"--group-size {args.group_size!r}: use auto, node, or a positive number")
        changes["group_size"] = int(args.group_size) if args.group_size.isdigit() else args.group_size
    if args.links:
        try:
            changes["links"] = resolve_links(args.links)
        except ValueError as err:
            parser.error(str(err))
    scenario = replace(scenario, **changes)
    per_node = scenario.gpus_per_node
    if args.nodes:
        scenario = replace(scenario, world_sizes=tuple(n * per_node for n in args.nodes))
    elif args.gpus_per_node:
        scenario = replace(scenario, world_sizes=tuple(w for w in (2 ** k for k in range(0, 13)) if w >= per_node))
    scenario = sim.with_links(scenario, intra_gbps=args.intra_bw, inter_gbps=args.inter_bw,
                              intra_latency_us=args.intra_latency_us, inter_latency_us=args.inter_latency_us,
                              memory_gb=args.memory_gb)
    simulation = sim.simulate(scenario)
    print(simreport.format_table(scenario, simulation))
    if args.memory:
        print()
        print(simreport.format_memory(scenario, simulation))
    if args.plot:
        try:
            simreport.plot(scenario, simulation, args.plot)
            print(f"plot written to {args.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


__all__ = ["plan_main", "side_by_side", "simulate_main", "tables_of_model"]
