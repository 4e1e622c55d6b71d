"""Lookup + update throughput of the sharded collection on one GPU, as achieved memory bandwidth.

One process, a 1x1 mesh (every table owned locally, no process group), pooled lookups with
``pooling`` ids per bag, row-wise AdaGrad. Per step: forward, backward of ``<out, G>``, sparse
update (the torch backend's ``kernel.step()``; FBGEMM fuses it into backward). Variants:

* ``ours``:       ``ShardedEmbeddingBagCollection`` (``--backend``: ``torch`` by default, the GPU path
  where FBGEMM's CUDA wheel is absent; ``fbgemm`` when it imports);
* ``raw_torch``:  the same work written directly: ``F.embedding_bag(sparse=True)`` per table and
  ``lightning_twod.sparse.optimizers.sparse_update``: what our layers add on top of the torch kernels;
* ``copy``:       a device-to-device copy of a large buffer: the bandwidth a memory-bound kernel
  can reach in practice (H200: about 4.3 TB/s of the 4.8 TB/s HBM peak).

Achieved bandwidth = the bytes a step must move at least, over its time. The model (fp32 rows of
``D`` columns, ``N`` ids, ``B x F`` bags, ``U`` distinct rows touched):

    forward   N x 8 (ids) + N x D x 4 (rows read) + B x F x D x 4 (pooled written)
    backward  B x F x D x 4 (output gradient read) + N x D x 4 (per-id gradient rows)
    update    U x D x 4 x 2 (rows read and written) + U x 4 x 2 (row-wise state)

``--dry`` runs tiny tables for a few iterations on CPU (what the tests run): it checks that the
script works, its numbers mean nothing. Results go to ``$OUT/gpu_bandwidth.json``.

    python benchmarks/gpu_bandwidth.py --out gpu-results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures  # noqa: E402
from lightning_twod.distributed import MeshGroups  # noqa: E402
from lightning_twod.sparse.kernels import fbgemm_available  # noqa: E402
from lightning_twod.sparse.optimizers import SparseOptimizerConfig, coalesce_rows, sparse_update  # noqa: E402
from lightning_twod.sparse.sharded import ShardedEmbeddingBagCollection, ShardingSpec  # noqa: E402
from lightning_twod.sparse.timing import PhaseTimer  # noqa: E402

PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "L4": 0.3}  # HBM/GDDR peak, TB/s, vendor specs


class Clock:
    """Wall time with CUDA events on a GPU, ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn, iters: int) -> float:
        """Seconds per call of ``fn`` (median of ``iters`` single calls)."""
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def make_batch(tables: int, rows: int, batch: int, pooling: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(tables * batch * pooling, generator=gen, dtype=torch.float64)
    ids = (u**3 * rows).long().clamp(max=rows - 1)  # power law, as the synthetic data
    lengths = torch.full((tables * batch,), pooling, dtype=torch.int64)
    return ids.to(device), lengths.to(device)


def bytes_per_step(args, ids: torch.Tensor) -> dict[str, int]:
    n, d, bags = ids.numel(), args.dim, args.batch * args.tables
    per_table = ids.view(args.tables, -1)
    unique = sum(int(torch.unique(t).numel()) for t in per_table)
    return {"forward": n * 8 + n * d * 4 + bags * d * 4, "backward": bags * d * 4 + n * d * 4,
            "update": unique * d * 4 * 2 + unique * 4 * 2, "unique_rows": unique, "ids": n}


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.01, 1e-8)
    keys = [f"cat_{i}" for i in range(args.tables)]
    ids, lengths = make_batch(args.tables, args.rows, args.batch, args.pooling, device)
    grad = torch.randn(args.batch, args.tables * args.dim, device=device)
    clock = Clock(device)
    model = bytes_per_step(args, ids)
    total_bytes = model["forward"] + model["backward"] + model["update"]
    result = {"config": {k: v for k, v in vars(args).items()}, "bytes_model": model, "variants": {}}

    torch.manual_seed(0)
    module = EmbeddingBagCollection([EmbeddingTableConfig(f"t_{i}", args.rows, args.dim, [keys[i]])
                                     for i in range(args.tables)], device=device)
    sharded = ShardedEmbeddingBagCollection(module, ShardingSpec(MeshGroups.single_process(), optimizer=optimizer,
                                                                 backend=args.backend, device=device))
    sharded.validate_inputs = not args.no_check
    weights = [w.detach().clone() for w in (t.weight for t in module.embedding_bags.values())]
    states = [torch.zeros(args.rows, device=device) for _ in weights]
    del module
    features = SparseFeatures(keys, ids, lengths)

    def ours():
        sharded(features).values().backward(grad)
        for kernel in sharded.kernels():
            kernel.step()

    per_table_ids = ids.view(args.tables, -1)
    table_offsets = torch.arange(args.batch + 1, device=device) * args.pooling
    params = [torch.nn.Parameter(w) for w in weights]

    def raw_torch():
        outs = [F.embedding_bag(per_table_ids[t], params[t], table_offsets, mode="sum", sparse=True,
                                include_last_offset=True) for t in range(args.tables)]
        torch.cat(outs, dim=1).backward(grad)
        for param, state in zip(params, states, strict=True):
            g = param.grad.coalesce()
            rows, values = coalesce_rows(g.indices()[0], g.values())
            sparse_update(optimizer, param.data, state, rows, values)
            param.grad = None

    variants = {"ours": ours, "raw_torch": raw_torch}
    for name in args.variants:
        if name == "copy":
            continue
        fn = variants[name]
        for _ in range(args.warmup):
            fn()
        seconds = clock.time(fn, args.iters)
        result["variants"][name] = {"ms": seconds * 1e3, "achieved_TBps": total_bytes / seconds / 1e12}
    if "copy" in args.variants:
        numel = (args.copy_mb << 20) // 4
        src, dst = torch.empty(numel, device=device), torch.empty(numel, device=device)
        for _ in range(args.warmup):
            dst.copy_(src)
        seconds = clock.time(lambda: dst.copy_(src), args.iters)
        result["variants"]["copy"] = {"ms": seconds * 1e3, "achieved_TBps": 2 * numel * 4 / seconds / 1e12}
    if "ours" in args.variants:  # where ours' time goes (synchronized phases: slower than the run above)
        timer = PhaseTimer(torch.cuda.synchronize if device.type == "cuda" else None)
        sharded.timer = timer
        for _ in range(args.iters):
            sharded(features).values().backward(grad)
            with timer.phase("sparse_update"):
                for kernel in sharded.kernels():
                    kernel.step()
        sharded.timer = None
        result["variants"]["ours"]["phases_ms"] = timer.summary(args.iters)
        result["variants"]["ours"]["kernel"] = type(sharded.kernel).__name__
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TBPS.items() if k in name), None)
    result["device"] = {"name": name, "peak_TBps": peak, "torch": torch.__version__,
                        "cuda": torch.version.cuda, "fbgemm": fbgemm_available()}
    if peak:
        for row in result["variants"].values():
            row["fraction_of_peak"] = row["achieved_TBps"] / peak
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="torch", choices=("torch", "fbgemm", "auto"))
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--pooling", type=int, default=8, help="ids per bag")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--copy-mb", type=int, default=2048)
    parser.add_argument("--variants", default="ours,raw_torch,copy")
    parser.add_argument("--no-check", action="store_true", help="validate_inputs=False")
    parser.add_argument("--dry", action="store_true", help="tiny CPU run that only checks the script works")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    if args.dry:
        args.device, args.rows, args.dim, args.batch, args.pooling = "cpu", 1000, 8, 32, 2
        args.iters, args.warmup, args.copy_mb, args.tables = 2, 1, 1, 2
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_bandwidth.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    peak = result["device"]["peak_TBps"]
    print(f"device {result['device']['name']} (peak {peak} TB/s), torch {result['device']['torch']}; "
          f"bytes per step {sum(result['bytes_model'][k] for k in ('forward', 'backward', 'update')) / 1e6:.1f} MB")
    for name, row in result["variants"].items():
        frac = f", {100 * row['fraction_of_peak']:.0f}% of peak" if "fraction_of_peak" in row else ""
        print(f"  {name:<10} {row['ms']:9.3f} ms  {row['achieved_TBps']:7.3f} TB/s{frac}")
    if "phases_ms" in result["variants"].get("ours", {}):
        print("  ours, synchronized phases (ms):", ", ".join(f"{k} {v:.3f}" for k, v in
                                                            result["variants"]["ours"]["phases_ms"].items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
