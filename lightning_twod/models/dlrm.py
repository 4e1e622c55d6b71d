"""DLRM reference model: an ordinary unsharded LightningModule (no parallelism in here).

    dense [B, num_dense] -> bottom MLP -> [B, D]
    sparse (F features)  -> EmbeddingBagCollection -> F x [B, D]
    pairwise dot products of the F + 1 vectors -> [B, (F + 1) F / 2], concatenated with the
    bottom output -> top MLP -> logit [B]

Batches are ``{"dense": [B, num_dense], "sparse": SparseFeatures, "label": [B]}``, optionally with
``"index"`` ``[B]`` (the sample's position in its data; ``-1`` marks a padding sample that the data
modules add so that every rank runs the same number of batches: the loss, the metrics and the
predictions leave it out). The model logs ``train_loss`` every step, and per epoch ``train_ne``,
``val_loss``, ``val_auc``, ``val_ne``, ``val_calibration``, ``val_ctr`` (and ``test_*`` under
``trainer.test``): the metrics of :mod:`lightning_twod.metrics`, exact over all ranks.
``predict_step`` returns ``index``, ``logit``, ``probability`` and ``label`` per sample
(``lightning_twod.strategies.callbacks.PredictionWriter`` writes them to a file).

Under ``TwoDSparseStrategy`` the same code runs sharded: the strategy swaps ``self.sparse`` for
its sharded twin and trains the embedding rows with its sparse optimizer, so
``configure_optimizers`` then sees only the dense parameters. Unsharded, Adam trains everything.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_twod.checkpoint import is_distributed_checkpoint, load_from_checkpoint
from lightning_twod.metrics import AUC, CTR, Calibration, NormalizedEntropy
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingTableConfig


def mlp(sizes: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(n_in, n_out))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def real_samples(batch: dict) -> Tensor | None:
    """``[B]`` bool: the samples that are not padding (``index >= 0``); ``None`` without ``"index"``."""
    index = batch.get("index")
    return None if index is None else index >= 0


def click_loss(logits: Tensor, label: Tensor, real: Tensor | None) -> Tensor:
    """Mean binary cross-entropy over the real samples (``0`` when there are none)."""
    if real is None:
        return F.binary_cross_entropy_with_logits(logits, label)
    losses = F.binary_cross_entropy_with_logits(logits, label, reduction="none")
    return (losses * real).sum() / real.sum().clamp(min=1)


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
        self.val_auc, self.val_ne, self.val_calibration, self.val_ctr = AUC(), NormalizedEntropy(), Calibration(), CTR()
        self.test_auc, self.test_ne, self.test_calibration, self.test_ctr = (
            AUC(), NormalizedEntropy(), Calibration(), CTR())

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, **kwargs: Any) -> DLRM:
        """Lightning's ``load_from_checkpoint``, which also reads a distributed checkpoint directory
        (``lightning_twod.checkpoint.load_from_checkpoint``: the full tables, on one process)."""
        if isinstance(checkpoint_path, str | os.PathLike) and is_distributed_checkpoint(checkpoint_path):
            return load_from_checkpoint(cls, checkpoint_path, **kwargs)
        return super().load_from_checkpoint(checkpoint_path, **kwargs)

    def forward(self, batch: dict) -> Tensor:
        """Logits ``[B]``. The lookup comes first: a sharded lookup's rows travel while the bottom
        MLP runs, and are waited for when the interaction reads them."""
        pooled = self.sparse(batch["sparse"])
        dense = self.bottom(batch["dense"])
        vectors = torch.stack([dense, *[pooled[k] for k in pooled]], dim=1)  # [B, F + 1, D]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
        return self.top(torch.cat([dense, dots[:, i, j]], dim=1)).squeeze(1)

    def _scored(self, batch: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Loss over the real samples, and their logits and labels ``[B_real]``."""
        logits, label, real = self(batch), batch["label"], real_samples(batch)
        loss = click_loss(logits, label, real)
        if real is not None:
            logits, label = logits[real], label[real]
        return loss, logits, label

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss, logits, label = self._scored(batch)
        self.train_ne.update(logits, label)
        self.log("train_loss", loss, prog_bar=True, batch_size=label.numel())
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train_ne", self.train_ne.compute(), sync_dist=True)  # synced: the same on every rank
        self.train_ne.reset()

    def _eval_step(self, batch: dict, stage: str) -> None:
        loss, logits, label = self._scored(batch)
        for name in ("auc", "ne", "calibration"):
            getattr(self, f"{stage}_{name}").update(logits, label)
        getattr(self, f"{stage}_ctr").update(label)
        self.log(f"{stage}_loss", loss, sync_dist=True, batch_size=label.numel())

    def _eval_epoch_end(self, stage: str) -> None:
        metrics = {f"{stage}_{name}": getattr(self, f"{stage}_{name}") for name in ("auc", "ne", "calibration", "ctr")}
        values = {key: metric.compute() for key, metric in metrics.items()}  # synced over ranks
        for key, value in values.items():
            self.log(key, value, prog_bar=key.endswith(("_auc", "_ne")), sync_dist=True)  # equal on every rank
        for metric in metrics.values():
            metric.reset()
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

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """``{"index", "logit", "probability", "label"}``, each ``[B_real]`` (padding left out; ``index``
        and ``label`` only when the batch has them)."""
        logits, real = self(batch), real_samples(batch)
        keep = slice(None) if real is None else real
        out = {"index": batch["index"][keep]} if "index" in batch else {}
        out["logit"] = logits[keep]
        out["probability"] = torch.sigmoid(out["logit"])
        if "label" in batch:
            out["label"] = batch["label"][keep]
        return out

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)
