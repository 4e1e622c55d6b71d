"""Bytes per training step inside a node and across nodes: 1D, 2D contiguous, 2D strided.

8 CPU processes pose as 2 nodes of 4 ranks (ranks 0-3 on node 0, 4-7 on node 1). Each layout
trains a few steps of 8 table-wise tables (SYNTHETIC power-law clicks, one id per feature) with
the sharded engine and the touched-rows replica reduction; every rank's byte counters are split
by whether the peer is on its own node. Next to them, the planner's prediction for the same plan
and batch: the all-to-all per peer from ``peer_volumes``, the replica reduction from
``predict_traffic`` (its touched-rows term assumes ids spread evenly over the rows, so it is an
upper bound for power-law ids). Also 2D contiguous with ``comm_dtype=bf16``.

    python benchmarks/traffic.py            # prints the table, writes benchmarks/results/traffic.md

The figure (``traffic.png``) goes to the twin of ``--out`` under ``benchmarks/out`` (git-ignored;
beside the page when ``--out`` is not under ``benchmarks/results``: ``outputs.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ``benchmarks.outputs`` when run as a script
from benchmarks.outputs import raw_dir  # noqa: E402

WORLD, PER_NODE = 8, 4
TABLES, ROWS, DIM = 8, 20_000, 64
LOCAL_BATCH, STEPS = 256, 4
LAYOUTS = {  # name: (shard_group_size, placement, comm dtype, sync_interval)
    "1D (1 x 8)": (8, "contiguous", None, 1),
    "2D contiguous (2 x 4)": (4, "contiguous", None, 1),
    "2D strided (2 x 4)": (4, "strided", None, 1),
    "2D contiguous, bf16 wire": (4, "contiguous", torch.bfloat16, 1),
    "2D contiguous, reduction every 4 steps": (4, "contiguous", None, 4),
}


def _tables():
    from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingTableConfig

    torch.manual_seed(0)
    return EmbeddingBagCollection([EmbeddingTableConfig(f"t_cat_{f}", ROWS, DIM, [f"cat_{f}"])
                                   for f in range(TABLES)])


def _plan(group: int, comm_bytes: int, sync_interval: int = 1):
    from lightning_twod.planner import Workload, plan_model, specs_from_configs

    specs = specs_from_configs({"sparse": _tables().tables})
    workload = Workload(batch_size=LOCAL_BATCH, comm_bytes=comm_bytes, sync_interval=sync_interval)
    constraints = {t.name: "table_wise" for t in specs["sparse"]}
    return specs["sparse"], plan_model(specs, WORLD, group, workload, constraints=constraints), workload


def _worker(rank: int, init_file: str, queue) -> None:
    from lightning_twod.datasets.synthetic import SyntheticClicks
    from lightning_twod.distributed import MeshGroups, SparseParallelDims, destroy_process_groups_at_exit
    from lightning_twod.distributed.comm import ByteCounter
    from lightning_twod.replication import ReplicaReducer, ReplicatedKernel
    from lightning_twod.sparse.optimizers import SparseOptimizerConfig
    from lightning_twod.sparse.sharded import ShardingSpec
    from lightning_twod.sparse.wrap import shard_collection

    destroy_process_groups_at_exit()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    data = SyntheticClicks([ROWS] * TABLES, WORLD * LOCAL_BATCH * STEPS, seed=0)
    results = {}
    for name, (group, placement, dtype, interval) in LAYOUTS.items():
        dims = SparseParallelDims(WORLD, group, placement, ranks_per_node=PER_NODE)
        groups = MeshGroups.create(dims)
        _, plan, _ = _plan(group, 2 if dtype is not None else 4)
        counter = ByteCounter(rank, WORLD)
        sharded = shard_collection(_tables(), ShardingSpec(groups, backend="torch", grad_scale=1 / group,
                                                           comm_dtype=dtype, counter=counter,
                                                           optimizer=SparseOptimizerConfig("rowwise_adagrad", 0.05)),
                                   plan=plan.shardings("sparse"))
        sharded.validate_inputs = False
        reducer = ReplicaReducer([ReplicatedKernel(sharded.kernel, groups.replica, groups.replica_ranks)],
                                 counter=counter)
        for step in range(STEPS):
            start = (step * WORLD + rank) * LOCAL_BATCH
            batch = data.collate(list(range(start, start + LOCAL_BATCH)))
            sharded(batch["sparse"]).values().pow(2).mean().backward()
            sharded.kernel.step()
            if (step + 1) % interval == 0:
                reducer.reduce()
        node = rank // PER_NODE
        same = [p for p in range(WORLD) if p // PER_NODE == node]
        other = [p for p in range(WORLD) if p // PER_NODE != node]
        results[name] = {
            "intra_node": counter.total(peers=same) / STEPS, "cross_node": counter.total(peers=other) / STEPS,
            "by_name": {k: v / STEPS for k, v in counter.by_name().items()},
            "shard_peers": groups.shard_ranks, "replica_peers": groups.replica_ranks,
        }
    queue.put((rank, results))
    dist.destroy_process_group()


def predict(name: str, rank: int, shard_peers: list[int], replica_peers: list[int]) -> dict[str, float]:
    """The planner's bytes per step for ``rank``, split by the node of each peer."""
    from lightning_twod.planner import predict_traffic
    from lightning_twod.planner.traffic import peer_volumes

    group, _, dtype, interval = LAYOUTS[name]
    specs, plan, workload = _plan(group, 2 if dtype is not None else 4, interval)
    to_owner, back = peer_volumes(specs, plan.shardings("sparse"), group, workload)
    me = shard_peers.index(rank)
    node = rank // PER_NODE
    out = {"intra_node": 0.0, "cross_node": 0.0}
    for position, peer in enumerate(shard_peers):
        if peer == rank:
            continue
        # input dist to the peer's shards, pooled rows back to it, their gradients back to it
        sent = to_owner[position] + back[me] + back[position]
        out["intra_node" if peer // PER_NODE == node else "cross_node"] += sent
    sync = predict_traffic(specs, plan.shardings("sparse"), group, WORLD // group, workload,
                           steps=STEPS)[me]["replica_sync"] / STEPS
    for peer in replica_peers:
        if peer != rank:
            out["intra_node" if peer // PER_NODE == node else "cross_node"] += sync / (len(replica_peers) - 1)
    return out


def measure() -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), queue)) for r in range(WORLD)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=900) for _ in range(WORLD))
        for proc in procs:
            proc.join()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    results = measure()
    lines = [
        "# Traffic by link class: bytes per training step and rank",
        "",
        f"8 CPU processes as 2 nodes of 4; {TABLES} table-wise tables of {ROWS:,} x {DIM} (SYNTHETIC power-law "
        f"ids, one per feature), {LOCAL_BATCH} samples per rank and step, row-wise AdaGrad, a replica "
        f"reduction every step unless said otherwise; mean of {STEPS} steps. Measured: the engine's byte counters; predicted: "
        "the planner. Reproduce: `python benchmarks/traffic.py`.",
        "",
        "| layout | measured intra-node KB | measured cross-node KB | predicted intra-node KB | "
        "predicted cross-node KB | measured output all-to-all KB |",
        "|---|---|---|---|---|---|",
    ]
    rows = []
    for name in LAYOUTS:
        measured = [results[r][name] for r in range(WORLD)]
        predicted = [predict(name, r, m["shard_peers"], m["replica_peers"]) for r, m in enumerate(measured)]
        mean = {k: sum(m[k] for m in measured) / WORLD / 1e3 for k in ("intra_node", "cross_node")}
        pred = {k: sum(p[k] for p in predicted) / WORLD / 1e3 for k in ("intra_node", "cross_node")}
        output = sum(m["by_name"].get("output_dist", 0) + m["by_name"].get("output_dist_grad", 0)
                     for m in measured) / WORLD / 1e3
        rows.append((name, mean, pred, output))
        lines.append(f"| {name} | {mean['intra_node']:.1f} | {mean['cross_node']:.1f} | {pred['intra_node']:.1f} | "
                     f"{pred['cross_node']:.1f} | {output:.1f} |")
    lines += ["", "The replica reduction is predicted for ids spread evenly over the rows; power-law ids touch "
              "fewer distinct rows, so its measured bytes are lower than predicted."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "traffic.md").write_text(text)
    raw = raw_dir(args.out)
    raw.mkdir(parents=True, exist_ok=True)
    _plot(rows, raw / "traffic.png")


def _plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1]["intra_node"] for r in rows], 0.4, label="intra-node (measured)")
    ax.bar([i + 0.2 for i in x], [r[1]["cross_node"] for r in rows], 0.4, label="cross-node (measured)")
    ax.scatter([i - 0.2 for i in x], [r[2]["intra_node"] for r in rows], color="k", marker="_", s=400,
               label="predicted", zorder=3)
    ax.scatter([i + 0.2 for i in x], [r[2]["cross_node"] for r in rows], color="k", marker="_", s=400, zorder=3)
    ax.set_xticks(list(x), [r[0] for r in rows], fontsize=8)
    ax.set_ylabel("KB per step and rank")
    ax.set_title("8 ranks as 2 nodes of 4: where the bytes go")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
