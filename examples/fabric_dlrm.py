"""The MovieLens-100K DLRM of the main job in a hand-written Lightning Fabric loop, on a 2x2 mesh.

    python examples/fabric_dlrm.py                      # 4 CPU processes (Fabric's launcher)
    python examples/fabric_dlrm.py --epochs 1 --devices 2 --shard-group-size 1
    torchrun --nproc-per-node=4 examples/fabric_dlrm.py # or under torchrun / SLURM

Prints the loss every 20 steps and, after each epoch, the validation AUC and normalized entropy
(the metrics of ``lightning_twod.metrics``, exact over the ranks), as ``./run.sh`` does. The
strategy shards the embedding tables at ``fabric.setup``; ``optimizer.step()`` runs the sparse step
and, every ``--sync-interval`` steps, the cross-group reduction; the first lookup in eval mode
drains a pending reduction, so the validation scores one model.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_twod import TwoDSparseFabricStrategy
from lightning_twod.datasets.movielens import MovieLens100K, MovieLensDataModule, load
from lightning_twod.metrics import AUC, NormalizedEntropy
from lightning_twod.models import DLRM


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--shard-group-size", type=int, default=2, help="ranks per shard group (default 2)")
    parser.add_argument("--sync-interval", type=int, default=1, help="steps between reductions (default 1)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per rank and step")
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_model() -> DLRM:
    """The DLRM of examples/configs/movielens_2x2.yaml."""
    return DLRM(table_rows=MovieLensDataModule.table_rows, pooling={"genres": "mean"}, embedding_dim=16,
                num_dense=MovieLensDataModule.num_dense, bottom_mlp=[32], top_mlp=[64, 32], lr=0.003)


@torch.no_grad()
def validate(fabric: Fabric, model, loader: DataLoader) -> dict[str, float]:
    model.eval()
    auc, ne = AUC().to(fabric.device), NormalizedEntropy().to(fabric.device)
    for batch in loader:
        logits = model(batch)
        auc.update(logits, batch["label"])
        ne.update(logits, batch["label"])
    model.train()
    return {"val_auc": float(auc.compute()), "val_ne": float(ne.compute())}  # synced over the ranks


def train(fabric: Fabric, args: argparse.Namespace) -> dict[str, float]:
    fabric.seed_everything(args.seed)
    data = load()
    train_set, val_set = MovieLens100K("train", data), MovieLens100K("validation", data)
    # the loaders first: the strategy plans the tables at fabric.setup for the first loader's batch
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True, collate_fn=train_set.collate),
        DataLoader(val_set, batch_size=args.batch_size, collate_fn=val_set.collate))
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=model.lr)  # the dense part; the tables go to the strategy
    model, optimizer = fabric.setup(model, optimizer)
    metrics, step = {}, 0
    for epoch in range(args.epochs):
        for index, batch in enumerate(train_loader):
            if args.max_steps is not None and index >= args.max_steps:
                break
            loss = F.binary_cross_entropy_with_logits(model(batch), batch["label"])
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0:
                fabric.print(f"epoch {epoch} step {step}: train loss {loss.detach().item():.4f}")
        metrics = validate(fabric, model, val_loader)
        fabric.print(f"epoch {epoch} step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    strategy = TwoDSparseFabricStrategy(shard_group_size=args.shard_group_size, sync_interval=args.sync_interval,
                                        sparse_optimizer="momentum_rowwise_adagrad", sparse_lr=0.05,
                                        sharding={"t_user_id": "row_wise", "t_item_id": "row_wise"})
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    train(fabric, args)


if __name__ == "__main__":
    main()
