"""One small cell of the step-time model's calibration, on this host: predicted against measured.

4 processes as two "nodes" of 2 train a 2 x 2 contiguous layout with a blocking reduction every 2
steps. Inside one spawned job the ranks measure what the model takes as input (the links probe,
and the step of the same model with nothing to exchange: one rank per shard group, no reduction),
then train the cell, and the prediction is compared with the measured step. The local step, the
cell and the probe alternate ``--repeats`` times; the median cell is compared with the median
probe's prediction. The bound is the calibration target of ``benchmarks/calibration.py`` (every
cell within 25 %); it holds on a quiet host, and a busy one moves the measured step, not the
prediction's inputs alone, so it is a benchmark, not a test (``tests/system/test_planner_calibration.py``
runs the cell once and checks what does not depend on load).

    python benchmarks/calibration_cell.py [--repeats 3]     # exit status 1 when outside the bound
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

TABLES, ROWS, DIM, BATCH, MAX_IDS = 4, 20_000, 32, 256, 5
WARMUP, TIMED = 3, 8
TOLERANCE = 0.25  # benchmarks/calibration.py: every cell within 25 %
WORLD = 4


class _Data(torch.utils.data.Dataset):
    def __init__(self, rank: int, steps: int) -> None:
        self.rank, self.steps = rank, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict:
        from lightning_twod import SparseFeatures

        gen = torch.Generator().manual_seed(1000 * self.rank + step)
        lengths = torch.randint(1, MAX_IDS + 1, (TABLES * BATCH,), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
        values = (u ** 3.0 * ROWS).long().clamp(max=ROWS - 1)
        return {"dense": torch.randn(BATCH, 13, generator=gen), "label": torch.rand(BATCH, generator=gen).round(),
                "sparse": SparseFeatures([f"cat_{i}" for i in range(TABLES)], values, lengths)}


def _timed_fit(rank: int, **strategy_options) -> tuple[float, object]:
    """Slowest rank's seconds per step over the timed steps, and the strategy."""
    import lightning.pytorch as pl
    import torch.nn.functional as F

    from lightning_twod import TwoDSparseStrategy
    from lightning_twod.models.dlrm import DLRM

    marks: list[float] = []

    class Timed(DLRM):
        def training_step(self, batch, batch_idx):
            return F.binary_cross_entropy_with_logits(self(batch), batch["label"])

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == WARMUP:
                marks.append(time.perf_counter())

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == WARMUP + TIMED - 1:
                marks.append(time.perf_counter())

    torch.manual_seed(0)
    model = Timed(table_rows=[ROWS] * TABLES, embedding_dim=DIM, num_dense=13, bottom_mlp=[64], top_mlp=[64, 32])
    strategy = TwoDSparseStrategy(timeout=120, planner_batch_size=BATCH, kernel_backend="torch", **strategy_options)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=WARMUP + TIMED,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    loader = torch.utils.data.DataLoader(_Data(rank, WARMUP + TIMED), batch_size=None)
    trainer.fit(model, train_dataloaders=loader)
    seconds = torch.tensor([(marks[1] - marks[0]) / TIMED])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds), strategy


def cell_worker(rank: int, world: int, port: int, repeats: int) -> dict:
    """One rank of the cell (in an initialized gloo group of ``world`` = 4): the measured steps (s)
    and the prediction of the median probe, with its phases."""
    from lightning_twod.hardware.probe import measure
    from lightning_twod.planner import DenseModel, TableSpec, Workload, step_time

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                      NODE_RANK=str(rank // 2), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cell = dict(shard_group_size=2, placement="contiguous", sync_interval=2)
    local, measured, probed = [], [], []
    for _ in range(repeats):
        local.append(_timed_fit(rank, shard_group_size=1, sync_interval=10**6)[0])
        seconds, strategy = _timed_fit(rank, **cell)
        measured.append(seconds)
        probed.append(measure(2, torch.device("cpu")))
    specs = {"sparse": [TableSpec(f"t_cat_{i}", ROWS, DIM, pooling_factor=(1 + MAX_IDS) / 2, id_skew=3.0)
                        for i in range(TABLES)]}
    dense_params = sum(p.numel() for n, p in strategy.lightning_module.named_parameters() if not n.startswith("sparse"))
    dense = DenseModel(dense_params, local_step_seconds=statistics.median(local))
    plan = strategy.sharding_plan
    predictions = sorted((step_time(specs, plan.modules, world, 2, "contiguous", 2,
                                    Workload(batch_size=BATCH, sync_interval=2), links, dense) for links in probed),
                         key=lambda p: p.total)
    predicted = predictions[len(predictions) // 2]  # the median probe's
    return {"measured": statistics.median(measured), "predicted": predicted.total, "local": statistics.median(local),
            "phases": {p: getattr(predicted, p) for p in predicted.PHASES}, "layout": (plan.shard_group_size,
                                                                                     plan.placement),
            "each": [(p.total * 1e3, p.phases_ms()) for p in predictions], "cells": [s * 1e3 for s in measured]}


def _spawned(rank: int, init: str, port: int, repeats: int, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        out = cell_worker(rank, WORLD, port, repeats)
        dist.barrier()
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import socket
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="local step, cell and probe, alternated (medians)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(f"file://{os.path.join(tmp, 'store')}", port, args.repeats, results),
                           nprocs=WORLD, join=True, start_method="spawn")
    r = results.get()
    error = r["predicted"] / r["measured"] - 1
    print(f"measured {r['measured'] * 1e3:.1f} ms, predicted {r['predicted'] * 1e3:.1f} ms ({error:+.1%}, bound "
          f"{TOLERANCE:.0%}); local step {r['local'] * 1e3:.1f} ms\nmeasured cells {r['cells']}\nprobes {r['each']}")
    return 0 if abs(error) <= TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())
