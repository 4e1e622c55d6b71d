"""Shared test inputs: tables covering every sharding type and a seeded random global batch."""

from __future__ import annotations

import torch

from lightning_twod.core.features import SparseFeatures
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingCollection, EmbeddingTableConfig

# (name, rows, dim, features, pooling, sharding type)
POOLED_TABLES = [
    ("t_tw", 37, 8, ["f_tw"], "sum", "table_wise"),
    ("t_rw", 53, 8, ["f_rw", "f_rw_shared"], "mean", "row_wise"),  # a shared table
    ("t_cw", 29, 16, ["f_cw"], "sum", "column_wise"),
    ("t_dp", 11, 4, ["f_dp"], "mean", "data_parallel"),
    ("t_tw2", 5, 4, ["f_tw2"], "sum", "table_wise"),  # fewer rows than ranks: short row chunks
]
WEIGHTED = {"f_tw", "f_rw"}  # features that carry per-id weights


def tables(pooled: bool) -> list[EmbeddingTableConfig]:
    return [
        EmbeddingTableConfig(name, rows, dim, feats, pooling if pooled else "none")
        for name, rows, dim, feats, pooling, _ in POOLED_TABLES
    ]


def constraints() -> dict[str, str]:
    return {name: kind for name, _, _, _, _, kind in POOLED_TABLES}


def make_module(pooled: bool, seed: int = 0):
    torch.manual_seed(seed)
    cls = EmbeddingBagCollection if pooled else EmbeddingCollection
    return cls(tables(pooled))


def random_batch(batch_size: int, seed: int, weighted: bool = True, max_len: int = 4) -> SparseFeatures:
    """A global batch over every feature: bag lengths 0..max_len (empty bags included)."""
    gen = torch.Generator().manual_seed(seed)
    data, weights = {}, {}
    for _, rows, _, feats, _, _ in POOLED_TABLES:
        for feature in feats:
            lengths = torch.randint(0, max_len + 1, (batch_size,), generator=gen)
            data[feature] = [torch.randint(0, rows, (int(n),), generator=gen).tolist() for n in lengths]
            if weighted and feature in WEIGHTED:
                weights[feature] = [torch.rand(int(n), generator=gen).tolist() for n in lengths]
    return SparseFeatures.from_dict(data, weights=weights or None)
