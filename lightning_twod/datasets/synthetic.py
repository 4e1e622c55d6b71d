"""Synthetic Criteo-like click data (SYNTHETIC: no real users), reproducible by seed.

Each sample has ``num_dense`` dense features and one id per sparse feature. Ids follow a power
law (a few ids are very frequent, as in real click logs): ``id = floor(rows * u ** skew)``,
``u ~ U(0, 1)``. Labels come from a planted model, so the best achievable loss is known to exist:
``logit = dense @ w + sum_f bias_f[id_f]``, ``label ~ Bernoulli(sigmoid(logit))``.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_twod.sparse.features import SparseFeatures


class SyntheticClicks(Dataset):
    """``num_samples`` samples; ``dataset[i]`` is the index ``i`` (batches are built by ``collate``)."""

    def __init__(self, table_rows: Sequence[int], num_samples: int, num_dense: int = 13, skew: float = 3.0,
                 seed: int = 0, split: int = 0) -> None:
        planted = torch.Generator().manual_seed(seed)  # the model: shared by every split of a seed
        planted_w = torch.randn(num_dense, generator=planted) / num_dense ** 0.5
        planted_bias = [torch.randn(n, generator=planted) for n in table_rows]
        gen = torch.Generator().manual_seed(seed * 1009 + 1 + split)  # the samples of this split
        self.keys = [f"cat_{f}" for f in range(len(table_rows))]
        self.dense = torch.randn(num_samples, num_dense, generator=gen)
        uniform = torch.rand(num_samples, len(table_rows), generator=gen)
        rows = torch.tensor(list(table_rows), dtype=torch.float64)
        self.ids = (uniform.double() ** skew * rows).long().clamp(max=rows.long() - 1)  # [N, F]
        logit = self.dense @ planted_w
        for f, bias in enumerate(planted_bias):
            logit = logit + bias[self.ids[:, f]] / len(table_rows) ** 0.5
        self.labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)

    def __len__(self) -> int:
        return self.labels.numel()

    def __getitem__(self, index: int) -> int:
        return index

    def collate(self, indices: list[int]) -> dict[str, Tensor | SparseFeatures]:
        """``{"dense": [B, num_dense], "sparse": SparseFeatures (one id per feature), "label": [B]}``."""
        idx = torch.tensor(indices, dtype=torch.int64)
        ids = self.ids[idx]  # [B, F]
        sparse = SparseFeatures(self.keys, ids.t().flatten(), torch.ones(ids.numel(), dtype=torch.int64))
        return {"dense": self.dense[idx], "sparse": sparse, "label": self.labels[idx]}


class SyntheticDataModule(pl.LightningDataModule):
    """Train/validation splits of ``SyntheticClicks`` (different seeds), batch size per rank."""

    def __init__(self, table_rows: Sequence[int] = (1000,) * 8, num_train: int = 16384, num_val: int = 4096,
                 num_dense: int = 13, batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.table_rows = list(table_rows)
        self.num_train, self.num_val, self.num_dense = num_train, num_val, num_dense
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: str | None = None) -> None:
        self.train = SyntheticClicks(self.table_rows, self.num_train, self.num_dense, seed=self.seed, split=0)
        self.val = SyntheticClicks(self.table_rows, self.num_val, self.num_dense, seed=self.seed, split=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, collate_fn=self.train.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self.val.collate)

