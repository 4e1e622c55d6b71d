"""Overhead of our layers over the raw FBGEMM kernel: one process, lookup + fused update.

The same tables, the same ids, the same optimizer (row-wise AdaGrad fused into backward):

* ``raw``:    FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` called directly: forward with
  ``(ids, offsets)``, backward of ``<out, G>``;
* ``ours``:   ``ShardedEmbeddingBagCollection`` on a 1x1 mesh (the FBGEMM kernel inside, every table
  owned locally, no process group): ``SparseFeatures`` in, input checks, routing, kernel, output
  assembly into ``PooledEmbeddings``, backward of the same ``<out, G>``;
* ``ours_nocheck``: the same with ``validate_inputs=False``;
* ``torch``: the same collection on the pure torch backend (lookup, backward, then the sparse
  row-wise AdaGrad step), for reference.

Runs alternate (raw, ours, ...) ``--repeats`` times and each keeps the median of its iterations,
so drift of a shared machine hits all of them alike. Prints ms per step and the ratio to ``raw``,
and ours' phase breakdown (``lightning_twod.sparse.timing``). One thread (``torch.set_num_threads``).

    python benchmarks/kernels.py --json benchmarks/results/kernels.json --plot benchmarks/out/kernels.png

The JSON (small, what ``benchmarks/results/README.md``'s table is made from) is kept in git; the
figure goes to ``benchmarks/out`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures  # noqa: E402
from lightning_twod.distributed import MeshGroups  # noqa: E402
from lightning_twod.sparse.optimizers import SparseOptimizerConfig  # noqa: E402
from lightning_twod.sparse.sharded import ShardedEmbeddingBagCollection, ShardingSpec  # noqa: E402
from lightning_twod.sparse.timing import PhaseTimer  # noqa: E402

VARIANTS = ("raw", "ours", "ours_nocheck", "torch")


def make_ids(tables: int, rows: int, batch: int, pooling: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Power-law ids (as the synthetic data: ``rows * u**3``), ``pooling`` ids per bag, key-major."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(tables * batch * pooling, generator=gen, dtype=torch.float64)
    ids = (u**3 * rows).long().clamp(max=rows - 1)
    lengths = torch.full((tables * batch,), pooling, dtype=torch.int64)
    return ids, lengths


def build(variant: str, tables: int, rows: int, dim: int, optimizer: SparseOptimizerConfig, timer=None):
    """A step function ``step(ids, lengths, grad)`` of one variant (lookup, backward, update)."""
    torch.manual_seed(0)
    if variant == "raw":
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            OptimType,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        lr, eps = optimizer.rowwise_lr_eps()
        op = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
            optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM,
        )

        def step(ids, lengths, grad):
            offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
            op(ids, offsets).backward(grad)

        return step
    keys = [f"cat_{i}" for i in range(tables)]
    module = EmbeddingBagCollection([EmbeddingTableConfig(f"t_{i}", rows, dim, [keys[i]]) for i in range(tables)])
    backend = "torch" if variant == "torch" else "fbgemm"
    sharded = ShardedEmbeddingBagCollection(module, ShardingSpec(MeshGroups.single_process(), optimizer=optimizer,
                                                                 backend=backend))
    sharded.validate_inputs = variant != "ours_nocheck"
    sharded.timer = timer
    del module

    def step(ids, lengths, grad):
        out = sharded(SparseFeatures(keys, ids, lengths))
        out.values().backward(grad)
        if timer is not None:  # torch: the update; FBGEMM updated the rows in backward (the step only ends it)
            with timer.phase("sparse_update"):
                sharded.kernel.step()
        else:
            sharded.kernel.step()

    return step


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.01, 1e-8)
    results = {"config": vars(args).copy(), "batches": {}}
    for batch in args.batches:
        ids, lengths = make_ids(args.tables, args.rows, batch, args.pooling, seed=batch)
        grad = torch.randn(batch, args.tables * args.dim, generator=torch.Generator().manual_seed(1))
        timers = {v: PhaseTimer() for v in VARIANTS}
        steps = {v: build(v, args.tables, args.rows, args.dim, optimizer) for v in args.variants}
        timed = {v: build(v, args.tables, args.rows, args.dim, optimizer, timers[v])
                 for v in args.variants if v != "raw"}
        per_variant: dict[str, list[float]] = {v: [] for v in args.variants}
        for _ in range(args.warmup):
            for v in args.variants:
                steps[v](ids, lengths, grad)
        for _ in range(args.repeats):
            for v in args.variants:
                times = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    steps[v](ids, lengths, grad)
                    times.append(time.perf_counter() - start)
                per_variant[v].append(statistics.median(times))
        for step in timed.values():  # the breakdown, from separate instrumented instances
            for _ in range(args.iters):
                step(ids, lengths, grad)
        ms = {v: 1e3 * statistics.median(t) for v, t in per_variant.items()}
        row = {"ms": ms, "ms_repeats": {v: [1e3 * x for x in t] for v, t in per_variant.items()},
               "phases_ms": {v: timers[v].summary(args.iters) for v in timed}}
        if "raw" in ms:
            row["ratio_to_raw"] = {v: ms[v] / ms["raw"] for v in ms}
            # ratios repeat by repeat (adjacent runs), then the median
            row["ratio_to_raw_paired"] = {
                v: statistics.median(a / b for a, b in zip(per_variant[v], per_variant["raw"])) for v in ms}
        results["batches"][str(batch)] = row
        line = ", ".join(f"{v} {ms[v]:.3f} ms" + (f" ({row['ratio_to_raw_paired'][v]:.2f}x)" if "raw" in ms else "")
                         for v in args.variants)
        print(f"batch {batch:>6} x {args.tables} tables x {args.pooling} ids: {line}", flush=True)
        for v in timed:
            phases = ", ".join(f"{k} {t:.3f}" for k, t in row["phases_ms"][v].items())
            print(f"    {v} phases (ms/step, instrumented): {phases}", flush=True)
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    batches = sorted(int(b) for b in results["batches"])
    rows = [results["batches"][str(b)] for b in batches]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"raw": "#7f7f7f", "ours": "#1f77b4", "ours_nocheck": "#2ca02c", "torch": "#d62728"}
    labels = {"raw": "raw FBGEMM TBE", "ours": "ours (FBGEMM)", "ours_nocheck": "ours, validate_inputs=False",
              "torch": "ours, torch backend"}
    for v in cfg["variants"]:
        left.plot(batches, [r["ms"][v] for r in rows], "o-", color=colors[v], label=labels[v])
        if v != "raw" and "ratio_to_raw_paired" in rows[0]:
            right.plot(batches, [r["ratio_to_raw_paired"][v] for r in rows], "o-", color=colors[v],
                       label=f"{labels[v]} / raw")
            for b, r in zip(batches, rows):
                right.annotate(f"{r['ratio_to_raw_paired'][v]:.2f}", (b, r["ratio_to_raw_paired"][v]), fontsize=7,
                               textcoords="offset points", xytext=(3, 3))
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("batch (bags per table)")
    left.set_ylabel("ms per lookup + backward + update")
    left.legend()
    right.axhline(1.1, color="k", ls="--", lw=0.8, label="+10 %")
    right.axhline(1.0, color="k", lw=0.5)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch (bags per table)")
    right.set_ylabel("time / raw FBGEMM TBE (median of paired repeats)")
    right.legend()
    fig.suptitle(f"one process, {cfg['threads']} thread(s): {cfg['tables']} tables x {cfg['rows']:,} x {cfg['dim']}, "
                 f"{cfg['pooling']} id(s) per bag, row-wise AdaGrad fused")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--pooling", type=int, default=1, help="ids per bag")
    parser.add_argument("--batches", default="256,1024,4096,16384", help="comma-separated batch sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--replot", help="only redraw --plot from this JSON of an earlier run")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.variants = [v for v in str(args.variants).split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    start = time.time()
    results = measure(args)
    results["seconds"] = time.time() - start
    results["torch"] = torch.__version__
    results["load_avg_at_end"] = os.getloadavg()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
