"""What ``verify_replicas`` costs: the replica check's time against the training step's, on CPU.

A ``fit`` of the reference DLRM (``--tables`` tables of ``--rows x --dim``, batch ``--batch`` per
rank, row-wise AdaGrad state) on ``--world`` spawned gloo processes with ``shard_group_size=1``:
every rank holds a full replica of every table, the most a rank can have to digest. After each
training step every rank runs the check (``strategy.replica_check.verify()``: digest every shard's
weights and state, one all-gather, compare) and, separately, the digests alone; step and check
alternate, so load that comes and goes falls on both alike. Warm-up steps are not counted.

Prints, per rank, the median step, check and digest times, the load average before and after, and
what the check costs per step for each setting: ``"checkpoint"`` (once per checkpoint, and at the
end of fit: nothing per step) and ``N`` (once every ``N`` reductions; with ``sync_interval=1``,
every ``N`` steps)::

    python benchmarks/verify_replicas.py [--world 2] [--tables 8] [--rows 20000] [--dim 64] [--batch 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.datasets import SyntheticDataModule
from lightning_twod.models import DLRM
from lightning_twod.replication.verify import local_digests

EVERY = (1, 10, 100, 1000)


class Interleaved(pl.Callback):
    """Per step: the step's wall time, then the check's and the digests' (each rank writes its own file)."""

    def __init__(self, out: str, warmup: int) -> None:
        self.out, self.warmup = out, warmup
        self.steps, self.checks, self.digests = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = time.perf_counter() - self.start
        strategy = trainer.strategy
        start = time.perf_counter()
        strategy.replica_check.verify()
        check = time.perf_counter() - start
        start = time.perf_counter()
        local_digests(strategy.sparse_modules)
        digest = time.perf_counter() - start
        if batch_idx >= self.warmup:
            self.steps.append(step)
            self.checks.append(check)
            self.digests.append(digest)

    def on_train_end(self, trainer, pl_module) -> None:
        shards = sum(w.numel() for m in trainer.strategy.sparse_modules.values() for _, w in m.local_shards())
        result = dict(steps=self.steps, checks=self.checks, digests=self.digests, elements=shards,
                      threads=torch.get_num_threads())
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        rows = (args.rows,) * args.tables
        model = DLRM(table_rows=rows, embedding_dim=args.dim)
        data = SyntheticDataModule(table_rows=rows, num_train=args.batch * args.world * args.steps,
                                   batch_size=args.batch)
        strategy = TwoDSparseStrategy(shard_group_size=1, start_method="spawn", verify_replicas="off",
                                      sparse_optimizer="rowwise_adagrad", pipeline=False)
        trainer = pl.Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=args.steps,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             callbacks=[Interleaved(out, args.warmup)])
        trainer.fit(model, datamodule=data)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]
    load_after = os.getloadavg()
    print(f"{args.world} processes x {ranks[0]['threads']} thread(s), {args.tables} tables x {args.rows} x "
          f"{args.dim}, batch {args.batch} per rank, {len(ranks[0]['steps'])} steps timed; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min), cores {os.cpu_count()}")
    header = f"{'rank':>4} {'elements':>11} {'step ms':>8} {'check ms':>9} {'digest ms':>10}"
    header += "".join(f" {'N=' + str(n):>8}" for n in EVERY) + f" {'checkpoint':>11}"
    print(header)
    for rank, r in enumerate(ranks):
        step, check, digest = (statistics.median(r[k]) * 1e3 for k in ("steps", "checks", "digests"))
        line = f"{rank:>4} {r['elements']:>11,} {step:>8.2f} {check:>9.3f} {digest:>10.3f}"
        line += "".join(f" {check / (n * step):>8.3%}" for n in EVERY) + f" {0:>10.0%}"
        print(line)
    print("N=...: the check's cost per step with verify_replicas=N (sync_interval=1); checkpoint: nothing per step, "
          "one check per checkpoint and at the end of fit")


if __name__ == "__main__":
    main()
