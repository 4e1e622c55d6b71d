"""Synthetic Criteo-like click data (SYNTHETIC: no real users), generated on the fly, reproducible by seed.

Every value of sample ``i`` of a split is a function of ``(seed, split, i)`` alone (a 32-bit integer
hash, no stored arrays and no random generator state), so a batch is the same whatever the batch
size, the number of ranks, the order of the requests or the library versions, and tables of
millions of rows cost no memory here.

* ``num_dense`` dense features ~ N(0, 1) (Criteo: 13).
* one id per sparse feature (Criteo: 26), power-law distributed as in real click logs (a few ids
  are very frequent): ``id = floor(rows * u ** skew)``, ``u ~ U(0, 1)``.
* labels from a planted model, so that quality is learnable and its ceiling is known:
  ``logit = base_logit + dense @ w + sum_f bias_f(id_f) / sqrt(F)``, ``label ~ Bernoulli(sigmoid(logit))``,
  with ``w ~ N(0, 1 / num_dense)`` and ``bias_f(id)`` uniform with unit variance, hashed from
  ``(seed, f, id)``. :meth:`SyntheticClicks.planted_logits` returns the logits: their AUC is the
  best any model can reach on this data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_twod.core.features import SparseFeatures
from lightning_twod.datasets.sharding import eval_loader

CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE = 13, 26
_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x5BD1E995  # odd multipliers < 2**31: x * m stays inside int64 for x < 2**32
_DENSE, _SPARSE, _LABEL, _WEIGHT, _BIAS = range(5)  # streams of the hash


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def _hash(*parts: Tensor | int) -> Tensor:
    """Hash of several non-negative integers (tensors broadcast together) -> int64 in ``[0, 2**32)``."""
    h = torch.tensor(0x243F6A88, dtype=torch.int64)
    for part in parts:
        part = torch.as_tensor(part, dtype=torch.int64)
        h = _mix(h ^ (part & _MASK))
        h = _mix(h ^ ((part >> 32) & _MASK))
    return h


def _uniform(*parts: Tensor | int) -> Tensor:
    """float64 in ``(0, 1)`` from the hash of ``parts``."""
    return (_hash(*parts).double() + 0.5) / 2.0**32


class SyntheticClicks(Dataset):
    """``num_samples`` samples of one split; ``dataset[i]`` is the index ``i`` (batches are built by
    ``collate``). ``seed`` fixes the planted model and, with ``split``, the samples."""

    def __init__(self, table_rows: Sequence[int], num_samples: int, num_dense: int = 13, skew: float = 3.0,
                 seed: int = 0, split: int = 0, base_logit: float = 0.0) -> None:
        rows = [int(n) for n in table_rows]
        if not rows or min(rows) < 1:
            raise ValueError(f"table_rows must be positive, got {list(table_rows)}")
        if num_samples < 0 or num_dense < 0 or skew <= 0:
            raise ValueError(f"need num_samples >= 0, num_dense >= 0, skew > 0; got {num_samples}, {num_dense}, {skew}")
        self.table_rows, self.num_samples, self.num_dense = rows, int(num_samples), int(num_dense)
        self.skew, self.seed, self.split, self.base_logit = float(skew), int(seed), int(split), float(base_logit)
        self.keys = [f"cat_{f}" for f in range(len(rows))]
        self._rows = torch.tensor(rows, dtype=torch.int64)
        self.planted_weight = torch.special.ndtri(_uniform(self.seed, _WEIGHT, torch.arange(num_dense))).float()
        self.planted_weight /= math.sqrt(max(1, num_dense))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        return index

    def _sample(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """Dense ``[B, num_dense]`` and ids ``[B, F]`` of the given sample indices."""
        idx = indices.unsqueeze(1)
        dense = torch.special.ndtri(_uniform(self.seed, self.split, _DENSE, idx, torch.arange(self.num_dense)))
        u = _uniform(self.seed, self.split, _SPARSE, idx, torch.arange(len(self.table_rows)))
        ids = (u**self.skew * self._rows.double()).long().clamp(max=self._rows - 1)
        return dense.float(), ids

    def planted_bias(self, feature: int, ids: Tensor) -> Tensor:
        """The planted model's bias of ``ids`` of sparse feature ``feature`` (uniform, unit variance)."""
        return ((_uniform(self.seed, _BIAS, feature, ids) * 2 - 1) * math.sqrt(3.0)).float()

    def _logits(self, dense: Tensor, ids: Tensor) -> Tensor:
        logit = self.base_logit + dense @ self.planted_weight
        scale = 1.0 / math.sqrt(len(self.table_rows))
        for f in range(ids.shape[1]):
            logit = logit + self.planted_bias(f, ids[:, f]) * scale
        return logit

    def planted_logits(self, indices: Sequence[int] | Tensor) -> Tensor:
        """The planted model's logits of the given samples (the Bayes-optimal scores)."""
        return self._logits(*self._sample(torch.as_tensor(indices, dtype=torch.int64)))

    def collate(self, indices: Sequence[int]) -> dict[str, Tensor | SparseFeatures]:
        """``{"dense": [B, num_dense], "sparse": SparseFeatures (one id per feature), "label": [B],
        "index": [B]}``; index ``-1`` is a padding sample (sample 0's values, see ``sharding``)."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        idx = index.clamp(min=0)
        dense, ids = self._sample(idx)
        probability = torch.sigmoid(self._logits(dense, ids).double())
        label = (_uniform(self.seed, self.split, _LABEL, idx) < probability).float()
        sparse = SparseFeatures(self.keys, ids.t().flatten(), torch.ones(ids.numel(), dtype=torch.int64))
        return {"dense": dense, "sparse": sparse, "label": label, "index": index}


class SyntheticDataModule(pl.LightningDataModule):
    """Train / validation / test splits of ``SyntheticClicks`` (one planted model, different samples);
    batch size per rank. The model's tables need ``table_rows`` rows and ``num_dense`` dense inputs.
    ``test`` and ``predict`` read the test split (split 2), each sample exactly once over all ranks
    (``sharding.EvalShardSampler``).

    Criteo-like: 13 dense and 26 sparse features, e.g.
    ``SyntheticDataModule(table_rows=[1_000_000] * 4 + [10_000] * 22, base_logit=-1.2)`` (~25 % clicks).
    """

    def __init__(self, table_rows: Sequence[int] = (1000,) * 8, num_train: int = 16384, num_val: int = 4096,
                 num_test: int = 4096, num_dense: int = 13, batch_size: int = 64, seed: int = 0, skew: float = 3.0,
                 base_logit: float = 0.0, num_workers: int = 0) -> None:
        super().__init__()
        self.table_rows = list(table_rows)
        self.num_train, self.num_val, self.num_test, self.num_dense = num_train, num_val, num_test, num_dense
        self.batch_size, self.seed, self.skew, self.base_logit = batch_size, seed, skew, base_logit
        self.num_workers = num_workers

    def _split(self, num_samples: int, split: int) -> SyntheticClicks:
        return SyntheticClicks(self.table_rows, num_samples, self.num_dense, self.skew, self.seed, split,
                               self.base_logit)

    def setup(self, stage: str | None = None) -> None:
        self.train = self._split(self.num_train, 0)
        self.val = self._split(self.num_val, 1)
        self.test = self._split(self.num_test, 2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, collate_fn=self.train.collate,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self.val.collate,
                          num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return eval_loader(self.test, self.batch_size, self.trainer, self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return eval_loader(self.test, self.batch_size, self.trainer, self.num_workers)
