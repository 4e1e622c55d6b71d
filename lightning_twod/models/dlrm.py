"""DLRM reference model: an ordinary unsharded LightningModule (no parallelism in here).

    dense [B, num_dense] -> bottom MLP -> [B, D]
    sparse (F features)  -> EmbeddingBagCollection -> F x [B, D]
    pairwise dot products of the F + 1 vectors -> [B, (F + 1) F / 2], concatenated with the
    bottom output -> top MLP -> logit [B]
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingTableConfig


def mlp(sizes: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(pl.LightningModule):
    """Click-through model over ``dense``, ``sparse`` (``SparseFeatures``) and ``label`` batches."""

    def __init__(self, table_rows: Sequence[int] = (1000,) * 8, embedding_dim: int = 16, num_dense: int = 13,
                 bottom_mlp: Sequence[int] = (64,), top_mlp: Sequence[int] = (64, 32), lr: float = 0.01,
                 feature_names: Sequence[str] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        names = list(feature_names or [f"cat_{f}" for f in range(len(table_rows))])
        self.sparse = EmbeddingBagCollection([
            EmbeddingTableConfig(f"t_{name}", rows, embedding_dim, [name]) for name, rows in zip(names, table_rows)
        ])
        self.bottom = mlp([num_dense, *bottom_mlp, embedding_dim])
        vectors = len(names) + 1
        self.top = mlp([embedding_dim + vectors * (vectors - 1) // 2, *top_mlp, 1], last_activation=False)
        self.lr = lr

    def forward(self, batch: dict) -> Tensor:
        """Logits ``[B]``."""
        dense = self.bottom(batch["dense"])
        pooled = self.sparse(batch["sparse"])
        vectors = torch.stack([dense, *[pooled[k] for k in pooled]], dim=1)  # [B, F + 1, D]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
        return self.top(torch.cat([dense, dots[:, i, j]], dim=1)).squeeze(1)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch["label"])
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["label"].numel())
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = F.binary_cross_entropy_with_logits(self(batch), batch["label"])
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["label"].numel())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)
