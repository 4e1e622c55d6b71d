"""Trains a tiny DLRM on synthetic clicks with SGD for embedding rows and writes the final full
state dict and the mesh to --out. Launched by tests as a script (Lightning's subprocess launcher)
or under torchrun, never inside pytest itself."""

import argparse

import lightning.pytorch as pl
import torch

import lightning_twod
from lightning_twod.datasets.synthetic import SyntheticDataModule
from lightning_twod.models.dlrm import DLRM

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--num-nodes", type=int, default=1)
parser.add_argument("--strategy", default="twod_sparse", help="a registered name, or 'object'")
parser.add_argument("--placement", default="contiguous")
parser.add_argument("--shard-group-size", default="auto")
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()

ROWS = [300, 200, 100, 50]
pl.seed_everything(0)
model = DLRM(table_rows=ROWS, embedding_dim=8, bottom_mlp=[16], top_mlp=[16], lr=0.01)
data = SyntheticDataModule(table_rows=ROWS, num_train=args.steps * 8 * 4, num_val=64, batch_size=8)
if args.strategy == "object":
    size = args.shard_group_size if args.shard_group_size == "auto" else int(args.shard_group_size)
    strategy = lightning_twod.TwoDSparseStrategy(shard_group_size=size, placement=args.placement,
                                                 sparse_optimizer="sgd", sparse_lr=0.1)
else:
    strategy = args.strategy
trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                     max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0)
trainer.fit(model, data)
state = model.state_dict()  # a collective: full tables assembled from the shards
if trainer.is_global_zero:
    groups = trainer.strategy.mesh_groups.dims
    torch.save({"state_dict": state, "shard_groups": groups.shard_groups(), "replica_groups": groups.replica_groups(),
                "global_step": trainer.global_step, "sparse_optimizer": trainer.strategy.options.sparse_optimizer},
               args.out)
