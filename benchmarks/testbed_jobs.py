"""Small jobs for the two-node testbed (``cluster.py``); each rank runs this under torchrun.

    python benchmarks/testbed.py --rate 200mbit --nproc-per-node 1 -- \\
        benchmarks/testbed_jobs.py allreduce --mib 16 --repeats 3 --out allreduce.json
    python benchmarks/testbed.py -- benchmarks/testbed_jobs.py hold --seconds 600 --fail-node 1

``allreduce`` times a float32 gloo all-reduce across the nodes (after a warm-up one) and writes, from
rank 0, ``{"bytes", "world_size", "nodes", "seconds": [slowest rank's time of each repeat]}``.
Whatever the algorithm, every rank's result depends on all of the other node's buffers, so at
least ``bytes`` cross the link in each direction. ``hold`` sleeps on every rank, except that the
ranks of ``--fail-node`` exit with ``--code`` at once: a failing node next to one that would wait.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


def allreduce(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_twod.distributed import destroy_process_groups_at_exit

    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    destroy_process_groups_at_exit()
    buffer = torch.randn(args.mib * 2**20 // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    dist.all_reduce(buffer.clone())  # warm-up: pages touched, every pair's connection in use
    seconds = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        result = {"bytes": buffer.numel() * buffer.element_size(), "world_size": dist.get_world_size(),
                  "nodes": int(os.environ["GROUP_WORLD_SIZE"]), "seconds": slowest.tolist()}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"all_reduce of {result['bytes']} bytes: {', '.join(f'{s:.3f}' for s in result['seconds'])} s")


def hold(args: argparse.Namespace) -> None:
    node = int(os.environ["GROUP_RANK"])
    if node == args.fail_node:
        print(f"node {node}: exiting with code {args.code}", flush=True)
        sys.exit(args.code)
    time.sleep(args.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    jobs = parser.add_subparsers(dest="job", required=True)
    timed = jobs.add_parser("allreduce", help="time a float32 all-reduce across the nodes")
    timed.add_argument("--mib", type=int, default=16, help="buffer size in MiB (default 16)")
    timed.add_argument("--repeats", type=int, default=3)
    timed.add_argument("--out", required=True, help="JSON file written by rank 0")
    timed.set_defaults(run=allreduce)
    held = jobs.add_parser("hold", help="sleep, except on one node, which fails at once")
    held.add_argument("--seconds", type=float, default=600)
    held.add_argument("--fail-node", type=int, default=-1, help="node whose ranks exit at once (default none)")
    held.add_argument("--code", type=int, default=1, help="their exit code (default 1)")
    held.set_defaults(run=hold)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
