"""``lightning-twod calibrate``: measure this cluster's links and compute (``hardware.probe``) and write them as YAML.

Under torchrun every rank of the job takes part; otherwise ``--nproc`` local processes are started
(one node). Rank 0 prints the numbers, keeps them in the links cache (``planner/link_cache.py``: the
next set-ups with ``links="auto"`` on the same hosts, world size, ranks per node and device, and
``plan``, read them instead of probing) and writes the file that ``TwoDSparseStrategy(links=...)``,
``plan --links`` and ``simulate --links`` read. The probe (and torch) is imported when the command
is chosen (``cli.main``), never for another command.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_twod.hardware.probe import COLLECTIVE_TIMEOUT_S, PROBE_BUDGET_S, measure
from lightning_twod.hardware.resolve import job_key, remember
from lightning_twod.planner.links import LinkModel


def _calibrate_rank(rank: int, world: int, init: str, args) -> None:
    """One rank of ``calibrate``: join the group, measure, rank 0 reports."""
    device = torch.device(args.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if init == "env":
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    else:
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.timeout_s))
    try:
        rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        links = measure(rpn, device, budget_s=args.budget_s, timeout_s=args.timeout_s)
        links = _renamed(links, args.name, dist.get_world_size(), rpn, args.budget_s)
        if not args.no_cache:
            links = remember(links, job_key(dist.group.WORLD, rpn, device), dist.group.WORLD)
        if dist.get_rank() == 0:
            print(links.describe(), flush=True)
            if args.out:
                links.save(args.out)
                print(f"written to {args.out} (use it with TwoDSparseStrategy(links={args.out!r}))", flush=True)
    finally:
        dist.destroy_process_group()


def _renamed(links: LinkModel, name: str, world: int, rpn: int, budget: float) -> LinkModel:
    return replace(links, name=name, source=f"python -m lightning_twod calibrate on {world} ranks, {rpn} per node, "
                                            f"{budget:g} s budget, {time.strftime('%Y-%m-%d %H:%M:%S')}")


def calibrate_main(argv: list[str] | None = None) -> int:
    """``python -m lightning_twod calibrate``: measure this cluster's links and compute, print them,
    and write them as YAML for ``TwoDSparseStrategy(links=...)`` and ``simulate --links``."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_twod calibrate",
        description="Measure all-to-all and all-reduce bandwidth and latency inside and across nodes, and a "
                    "rank's lookup, copy and dense throughput, with every rank taking part at once. Under torchrun "
                    "it measures the job's ranks; otherwise it starts --nproc local processes (one node).")
    parser.add_argument("--out", help="write the numbers here (YAML)")
    parser.add_argument("--nproc", type=int, default=2, help="local processes when not under torchrun (default 2)")
    parser.add_argument("--ranks-per-node", type=int, help="default: torchrun's LOCAL_WORLD_SIZE, or --nproc")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--budget-s", type=float, default=PROBE_BUDGET_S,
                        help=f"seconds the probe may take (default {PROBE_BUDGET_S:g}, as at set-up; more is steadier)")
    parser.add_argument("--timeout-s", type=float, default=COLLECTIVE_TIMEOUT_S,
                        help="seconds a probe collective may wait before the probe fails")
    parser.add_argument("--name", default="calibrated", help="name recorded in the file")
    parser.add_argument("--no-cache", action="store_true",
                        help="do not keep the numbers in the links cache (by default every later set-up of "
                             "links='auto' on these hosts, ranks and device plans on them, for 7 days)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _calibrate_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env", args)
        return 0
    if args.nproc < 2:
        parser.error("--nproc must be >= 2: links are measured between processes")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_calibrate_rank, args=(args.nproc, f"file://{os.path.join(tmp, 'store')}", args),
                 nprocs=args.nproc, join=True)
    return 0
