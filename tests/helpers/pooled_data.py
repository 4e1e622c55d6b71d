"""A pooled synthetic click data module for ``DLRM`` (map-style; bags of several power-law ids).

Sample ``i`` is a pure function of ``(seed, i)``: bag sizes uniform in ``[1, max_ids]``, ids
``floor(rows * u ** skew)`` scattered by a bijection of the rows where ``hashed``. No global random
state is read, so a test can compare that state before and after whatever reads the data.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_twod import SparseFeatures


class PooledClicks(Dataset):
    """``num_samples`` samples; ``dataset[i]`` is ``{"dense": [num_dense], "ids": [per feature: list], "label"}``."""

    def __init__(self, table_rows: Sequence[int], num_samples: int, num_dense: int = 4, max_ids: int = 19,
                 skew: float = 3.0, hashed: bool = False, seed: int = 0) -> None:
        self.table_rows, self.num_samples, self.num_dense = list(table_rows), num_samples, num_dense
        self.max_ids, self.skew, self.hashed, self.seed = max_ids, skew, hashed, seed
        self.keys = [f"cat_{f}" for f in range(len(self.table_rows))]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = []
        for rows in self.table_rows:
            n = int(torch.randint(1, self.max_ids + 1, (), generator=gen))
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            bag = (u**self.skew * rows).long().clamp(max=rows - 1)
            ids.append(((bag * 2_654_435_761 + 12_345) % rows if self.hashed else bag).tolist())
        return {"dense": torch.randn(self.num_dense, generator=gen), "ids": ids,
                "label": float(torch.rand((), generator=gen) < 0.3)}

    def collate(self, items: list[dict]) -> dict:
        """``{"dense": [B, num_dense], "sparse": SparseFeatures, "label": [B]}`` (what ``DLRM`` reads)."""
        sparse = SparseFeatures.from_dict({key: [item["ids"][f] for item in items] for f, key in enumerate(self.keys)})
        return {"dense": torch.stack([item["dense"] for item in items]), "sparse": sparse,
                "label": torch.tensor([item["label"] for item in items])}


class Streamed(IterableDataset):
    """``PooledClicks``' samples as a stream (an ``IterableDataset``: no first batch without iterating)."""

    def __init__(self, data: PooledClicks) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


class PooledDataModule(pl.LightningDataModule):
    """``PooledClicks`` to train on (``seed_per_rank``: each rank its own seed, so each rank's first batch
    differs); ``streamed``: the same samples as an ``IterableDataset``."""

    def __init__(self, table_rows: Sequence[int], num_train: int = 256, batch_size: int = 32, num_dense: int = 4,
                 max_ids: int = 19, skew: float = 3.0, hashed: bool = False, seed_per_rank: bool = False,
                 streamed: bool = False) -> None:
        super().__init__()
        self.table_rows, self.num_train, self.batch_size, self.num_dense = list(table_rows), num_train, batch_size, num_dense
        self.max_ids, self.skew, self.hashed = max_ids, skew, hashed
        self.seed_per_rank, self.streamed = seed_per_rank, streamed

    def setup(self, stage: str | None = None) -> None:
        seed = self.trainer.global_rank if self.seed_per_rank and self.trainer is not None else 0
        self.train = PooledClicks(self.table_rows, self.num_train, self.num_dense, self.max_ids, self.skew,
                                  self.hashed, seed)

    def train_dataloader(self) -> DataLoader:
        dataset = Streamed(self.train) if self.streamed else self.train
        return DataLoader(dataset, batch_size=self.batch_size, collate_fn=self.train.collate,
                          shuffle=not self.streamed)
