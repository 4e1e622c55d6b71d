"""DLRM reference model: an ordinary unsharded LightningModule (no parallelism in here).

    dense [B, num_dense] -> bottom MLP -> [B, D]
    sparse (F features)  -> EmbeddingBagCollection -> F x [B, D]
    pairwise dot products of the F + 1 vectors -> [B, (F + 1) F / 2], concatenated with the
    bottom output -> top MLP -> logit [B]

Batches are ``{"dense": [B, num_dense], "sparse": SparseFeatures, "label": [B]}``. The model logs
``train_loss`` every step, and per epoch ``train_ne``, ``val_loss``, ``val_auc``, ``val_ne`` (and
``test_*`` under ``trainer.test``): AUC and normalized entropy from :mod:`lightning_twod.metrics`,
exact over all ranks. Under ``TwoDSparseStrategy`` the same code runs sharded: the strategy swaps
``self.sparse`` for its sharded twin and trains the embedding rows with its sparse optimizer, so
``configure_optimizers`` then sees only the dense parameters. Unsharded, Adam trains everything.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_twod.metrics import AUC, NormalizedEntropy
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingTableConfig


def mlp(sizes: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(n_in, n_out))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(pl.LightningModule):
    """Click-through model over ``dense``, ``sparse`` (``SparseFeatures``) and ``label`` batches.

    Args:
        table_rows: rows of each feature's table: a list (features ``cat_0``, ``cat_1``, ... or
            ``feature_names``) or a mapping ``{feature: rows}``. Feature ``f`` reads table ``t_f``.
        embedding_dim: columns of every table, and the width of the bottom MLP's output.
        num_dense: dense features per sample.
        bottom_mlp: hidden sizes of the bottom MLP (``num_dense -> ... -> embedding_dim``).
        top_mlp: hidden sizes of the top MLP (interaction -> ... -> 1 logit).
        lr: Adam's learning rate (dense parameters; all parameters when not sharded).
        feature_names: names of the features of a list ``table_rows``.
        pooling: per-feature pooling of multi-id bags, e.g. ``{"genres": "mean"}``; default ``"sum"``.
    """

    def __init__(self, table_rows: Sequence[int] | Mapping[str, int] = (1000,) * 8, embedding_dim: int = 16,
                 num_dense: int = 13, bottom_mlp: Sequence[int] = (64,), top_mlp: Sequence[int] = (64, 32),
                 lr: float = 0.01, feature_names: Sequence[str] | None = None,
                 pooling: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        if isinstance(table_rows, Mapping):
            if feature_names is not None and list(feature_names) != list(table_rows):
                raise ValueError(f"feature_names {list(feature_names)} disagree with the keys of table_rows "
                                 f"{list(table_rows)}; give the names once")
            names, rows = list(table_rows), list(table_rows.values())
        else:
            rows = list(table_rows)
            names = list(feature_names or [f"cat_{f}" for f in range(len(rows))])
            if len(names) != len(rows):
                raise ValueError(f"{len(names)} feature_names for {len(rows)} table_rows")
        pooling = dict(pooling or {})
        unknown = sorted(set(pooling) - set(names))
        if unknown:
            raise ValueError(f"pooling names unknown features {unknown}; the features are {names}")
        self.feature_names = names
        self.sparse = EmbeddingBagCollection([
            EmbeddingTableConfig(f"t_{name}", int(n), embedding_dim, [name], pooling=pooling.get(name, "sum"))
            for name, n in zip(names, rows)
        ])
        self.bottom = mlp([num_dense, *bottom_mlp, embedding_dim])
        vectors = len(names) + 1
        self.top = mlp([embedding_dim + vectors * (vectors - 1) // 2, *top_mlp, 1], last_activation=False)
        self.lr = lr
        self.train_ne = NormalizedEntropy()
        self.val_ne, self.val_auc = NormalizedEntropy(), AUC()
        self.test_ne, self.test_auc = NormalizedEntropy(), AUC()

    def forward(self, batch: dict) -> Tensor:
        """Logits ``[B]``."""
        dense = self.bottom(batch["dense"])
        pooled = self.sparse(batch["sparse"])
        vectors = torch.stack([dense, *[pooled[k] for k in pooled]], dim=1)  # [B, F + 1, D]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
        return self.top(torch.cat([dense, dots[:, i, j]], dim=1)).squeeze(1)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch["label"])
        self.train_ne.update(logits, batch["label"])
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["label"].numel())
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train_ne", self.train_ne.compute(), sync_dist=True)  # synced: the same on every rank
        self.train_ne.reset()

    def _eval_step(self, batch: dict, stage: str) -> None:
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch["label"])
        getattr(self, f"{stage}_ne").update(logits, batch["label"])
        getattr(self, f"{stage}_auc").update(logits, batch["label"])
        self.log(f"{stage}_loss", loss, sync_dist=True, batch_size=batch["label"].numel())

    def _eval_epoch_end(self, stage: str) -> None:
        ne, auc = getattr(self, f"{stage}_ne"), getattr(self, f"{stage}_auc")
        values = {f"{stage}_auc": auc.compute(), f"{stage}_ne": ne.compute()}  # synced over ranks
        self.log_dict(values, prog_bar=True, sync_dist=True)  # equal on every rank already
        ne.reset()
        auc.reset()
        if not self.trainer.sanity_checking:
            where = f"epoch {self.current_epoch} step {self.global_step}" if stage == "val" else "test"
            self.print(f"{where}: " + ", ".join(f"{k} {float(v):.4f}" for k, v in values.items()))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)
