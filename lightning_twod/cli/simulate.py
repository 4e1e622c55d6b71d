"""``lightning-twod simulate``: predicted step time and scaling of 1D and 2D from 8 to 4,096 GPUs.

The model is ``planner.simulate`` (its table and plot: ``planner.simreport``); the parser is
jsonargparse's, so ``--config`` takes a YAML of these options too. Imports the planner only (no
torch, no Lightning).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

from lightning_twod.planner.hardware import HARDWARE
from lightning_twod.planner.inputs import SYNC_BYTES, TableSpec
from lightning_twod.planner.links import resolve_links


def _load_tables(path: str) -> list[TableSpec]:
    """Tables from YAML: a list of ``{name, rows, dim, features?, pooling_factor?, id_skew?, hashed?}``."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entries = data["tables"] if isinstance(data, dict) else data
    return [TableSpec(**entry) for entry in entries]


def simulate_main(argv: Sequence[str] | None = None) -> int:
    from lightning_twod.planner import simreport
    from lightning_twod.planner import simulate as sim

    parser = ArgumentParser(
        prog="lightning-twod simulate",
        description="Predict step time and weak-scaling efficiency of 1D and of the best 2D layout (group size, "
                    "placement, reduction interval) at each world size.")
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML of these options")
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
    parser.add_argument("--overlap", action="store_true",
                        help="overlap the reduction with the next interval (a layout this round does not fit, or "
                             "where a round that holds less is faster, takes that one, blocking or on the fp32 wire: "
                             "the round column)")
    parser.add_argument("--sync-dtype", choices=tuple(SYNC_BYTES),
                        help="the reduction's wire type (likewise, fp32 where it fits better or is faster)")
    parser.add_argument("--group-size", type=int | str, help="2D shard group: auto (the fastest that fits), node, or a number")
    parser.add_argument("--placement", choices=("auto", "contiguous", "strided"))
    parser.add_argument("--plot", help="also write the scaling plot here (PNG)")
    parser.add_argument("--memory", action="store_true", help="also print the busiest rank's memory by category")
    parser.add_argument("--per-table", action="store_true",
                        help="also every table its own group size (PT rows; a greedy search: seconds per world size)")
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
    if args.per_table:
        changes["per_table"] = True
    if args.sync_dtype:
        changes["sync_bytes"] = SYNC_BYTES[args.sync_dtype]
    if args.dense_gflops is not None:
        changes["dense_flops_per_sample"] = args.dense_gflops * 1e9
    if args.group_size is not None:
        group = str(args.group_size)
        if not (group.isdigit() and int(group) > 0) and group not in ("auto", "node"):
            parser.error(f"--group-size {group!r}: use auto, node, or a positive number")
        changes["group_size"] = int(group) if group.isdigit() else group
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
    if args.per_table:
        print()
        print(simreport.format_per_table(simulation))
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

