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

from lightning_twod.planner.cost import GIB, HARDWARE, H100, TableSpec
from lightning_twod.planner.plan import ShardingPlan, _gib
from lightning_twod.planner.planner import PlanError, plan_for_strategy


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
                        help="machine whose bandwidths predict the load column")
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
    per_node = min(world, devices or world)
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

    model = _instantiate(config["model"])
    tables = tables_of_model(model)
    stats = {t.name: {"pooling_factor": args.pooling_factor} for ts in tables.values() for t in ts}
    common = dict(placement=init.get("placement", "contiguous"),
                  optimizer=init.get("sparse_optimizer", "rowwise_adagrad").replace("momentum_", ""),
                  sync_interval=int(init.get("sync_interval", 1)), stats=stats, hardware=hardware)
    constraints = init.get("sharding") or {}
    result = plan_for_strategy(tables, world, per_node, batch, memory, constraints,
                               init.get("shard_group_size", "auto"), **common)
    print(result.explanation)
    print(result.plan)
    one_d = None
    if result.group_size != world:
        try:
            one_d = plan_for_strategy(tables, world, per_node, batch, math.inf, constraints, world, **common).plan
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
    from lightning_twod.planner import simulate as sim

    parser = argparse.ArgumentParser(
        prog="python -m lightning_twod simulate",
        description="Predict step time and weak-scaling efficiency of 1D and 2D sparse parallelism.")
    parser.add_argument("--preset", choices=sorted(sim.PRESETS), default="paper",
                        help="starting scenario (every number below overrides it)")
    parser.add_argument("--tables", help="YAML list of tables {name, rows, dim, pooling_factor, ...}")
    parser.add_argument("--batch-size", type=int, help="samples per GPU")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--nodes", type=int, nargs="+", help="node counts to simulate (default: 1 .. 512)")
    parser.add_argument("--hardware", choices=sorted(HARDWARE))
    parser.add_argument("--intra-bw", type=float, help="GB/s per GPU inside a node")
    parser.add_argument("--inter-bw", type=float, help="GB/s per GPU across nodes")
    parser.add_argument("--intra-latency-us", type=float, help="microseconds per intra-node collective")
    parser.add_argument("--inter-latency-us", type=float, help="microseconds per remote peer message")
    parser.add_argument("--memory-gb", type=float, help="GB of memory per GPU")
    parser.add_argument("--dense-params", type=float, help="dense (DDP) parameters")
    parser.add_argument("--dense-gflops", type=float, help="dense GFLOP per sample, forward + backward")
    parser.add_argument("--sync-interval", type=int, help="steps between cross-group reductions")
    parser.add_argument("--group-size", help="2D shard group: auto (smallest that fits), node, or a number")
    parser.add_argument("--plot", default="simulate.png", help="PNG to write ('' for none)")
    args = parser.parse_args(argv)

    scenario = sim.PRESETS[args.preset]
    changes: dict[str, Any] = {}
    if args.tables:
        changes["tables"] = tuple(_load_tables(args.tables))
        changes["name"] = Path(args.tables).stem
    if args.hardware:
        changes["hardware"] = HARDWARE[args.hardware]
    for field_name, value in (("batch_size", args.batch_size), ("gpus_per_node", args.gpus_per_node),
                              ("dense_params", args.dense_params), ("sync_interval", args.sync_interval)):
        if value is not None:
            changes[field_name] = value
    if args.dense_gflops is not None:
        changes["dense_flops_per_sample"] = args.dense_gflops * 1e9
    if args.group_size:
        changes["group_size"] = int(args.group_size) if args.group_size.isdigit() else args.group_size
    scenario = replace(scenario, **changes)
    per_node = scenario.gpus_per_node
    if args.nodes:
        scenario = replace(scenario, world_sizes=tuple(n * per_node for n in args.nodes))
    elif args.gpus_per_node:
        scenario = replace(scenario, world_sizes=tuple(w for w in (2 ** k for k in range(0, 13)) if w >= per_node))
    scenario = sim.with_links(scenario, intra_gbps=args.intra_bw, inter_gbps=args.inter_bw,
                              intra_latency_us=args.intra_latency_us, inter_latency_us=args.inter_latency_us,
                              memory_gb=args.memory_gb)
    points = sim.simulate(scenario)
    print(sim.format_table(scenario, points))
    if args.plot:
        try:
            sim.plot(scenario, points, args.plot)
            print(f"plot written to {args.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


__all__ = ["plan_main", "side_by_side", "simulate_main", "tables_of_model"]
