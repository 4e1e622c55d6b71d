"""A short 2D sharded training run on CPU processes with SYNTHETIC click data.

Prints the mesh and the sharding plan, the training loss going down, and the bytes each rank
sent inside and across shard groups. ``python -m lightning_twod demo --help`` for the options.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch

from lightning_twod.datasets.synthetic import SyntheticDataModule
from lightning_twod.models.dlrm import DLRM
from lightning_twod.strategies.callbacks import TrafficMonitor
from lightning_twod.strategies.strategy import TwoDSparseStrategy


class LossPrinter(pl.Callback):
    """Prints rank 0's mean training loss over each window of ``every`` steps."""

    def __init__(self, every: int) -> None:
        self.every, self.window = every, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.window.append(float(outputs["loss"]))
        if len(self.window) == self.every and trainer.is_global_zero:
            print(f"step {trainer.global_step:>5}  train loss (mean of last {self.every}) "
                  f"{sum(self.window) / self.every:.4f}", flush=True)
        if len(self.window) == self.every:
            self.window = []


def main(argv: list[str] | None = None) -> pl.Trainer:
    parser = argparse.ArgumentParser(prog="python -m lightning_twod demo", description=__doc__)
    parser.add_argument("--processes", type=int, default=4, help="CPU processes (ranks)")
    parser.add_argument("--shard-group-size", type=int, default=2, help="ranks per shard group")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=128, help="samples per rank and step")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=5000, help="rows per table")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    rows = (args.rows,) * args.tables
    model = DLRM(table_rows=rows, embedding_dim=16, lr=0.003)
    data = SyntheticDataModule(table_rows=rows, num_train=args.steps * args.batch_size * args.processes,
                               batch_size=args.batch_size)
    strategy = TwoDSparseStrategy(shard_group_size=args.shard_group_size, start_method="spawn",
                                  sparse_lr=0.05, sharding={"t_cat_0": "row_wise"})
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.processes, strategy=strategy, max_epochs=1, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[LossPrinter(every=max(1, args.steps // 8)), TrafficMonitor()],
    )
    trainer.fit(model, data)
    return trainer
