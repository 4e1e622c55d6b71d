"""Sharded twins of TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection``.

A model written with ``torchrec.modules`` runs unchanged under the strategy: each TorchRec
collection is swapped for a twin built from its configs and weights, which takes the same
``KeyedJaggedTensor`` and returns TorchRec's own types (``KeyedTensor``; ``{feature: JaggedTensor}``).
The parameter keys stay TorchRec's (``embedding_bags.<table>.weight``, ``embeddings.<table>.weight``),
so ``state_dict()`` of the sharded model loads into the unsharded one. This module imports torchrec;
``wrap.py`` loads it only when the model holds a TorchRec collection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from lightning_twod.core.kjt import as_features
from lightning_twod.core.shards import TableSharding
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingCollection, EmbeddingTableConfig
from lightning_twod.sparse.sharded import (
    ShardedCollection,
    ShardedEmbeddingBagCollection,
    ShardedEmbeddingCollection,
    ShardingSpec,
)
from lightning_twod.sparse.wrap import split_twin

POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
DTYPES = {DataType.FP32: "fp32", DataType.FP16: "fp16"}  # -> EmbeddingTableConfig.dtype


def table_configs(module: nn.Module) -> list[EmbeddingTableConfig]:
    """The ``EmbeddingTableConfig`` of every table of a TorchRec collection, in its order."""
    bags = type(module).__name__ == "EmbeddingBagCollection"
    tables = []
    for config in module.embedding_bag_configs() if bags else module.embedding_configs():
        if config.data_type not in DTYPES:
            raise ValueError(f"TorchRec table {config.name!r} has data_type={config.data_type.name}; the sharded "
                             "twins keep fp32 or fp16 rows: use DataType.FP32 or DataType.FP16")
        pooling = POOLING.get(config.pooling) if bags else "none"
        if pooling is None:
            raise ValueError(f"TorchRec table {config.name!r} has pooling={config.pooling.name}; "
                             "use PoolingType.SUM or PoolingType.MEAN")
        tables.append(EmbeddingTableConfig(config.name, config.num_embeddings, config.embedding_dim,
                                           list(config.feature_names), pooling=pooling,
                                           dtype=DTYPES[config.data_type]))
    return tables


class TorchRecShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """Twin of ``torchrec.modules.EmbeddingBagCollection``: ``KeyedJaggedTensor`` -> ``KeyedTensor``."""

    def __init__(self, module: nn.Module, spec: ShardingSpec, plan: Mapping[str, TableSharding] | None = None,
                 siblings: Sequence[ShardedCollection] = (), path: str = "") -> None:
        super().__init__(EmbeddingBagCollection(table_configs(module), device="meta"), spec, plan, module.state_dict(),
                         siblings, path)
        self.weighted = module.is_weighted()

    def forward(self, features) -> KeyedTensor:
        features = as_features(features, "EmbeddingBagCollection")
        if not self.weighted and features.weights is not None:  # as TorchRec: an unweighted EBC ignores them
            features = type(features)(features.keys, features.values, features.lengths)
        pooled = super().forward(features)
        return KeyedTensor(keys=pooled.keys(), length_per_key=pooled.dims, values=pooled.values())


class TorchRecShardedEmbeddingCollection(ShardedEmbeddingCollection):
    """Twin of ``torchrec.modules.EmbeddingCollection``: ``KeyedJaggedTensor`` -> ``{feature: JaggedTensor}``."""

    def __init__(self, module: nn.Module, spec: ShardingSpec, plan: Mapping[str, TableSharding] | None = None,
                 siblings: Sequence[ShardedCollection] = (), path: str = "") -> None:
        super().__init__(EmbeddingCollection(table_configs(module), device="meta"), spec, plan, module.state_dict(),
                         siblings, path)
        self.need_indices = module.need_indices()

    def forward(self, features) -> dict[str, JaggedTensor]:
        features = as_features(features, "EmbeddingCollection")
        if features.weights is not None:  # TorchRec's EmbeddingCollection does not weight its rows
            features = type(features)(features.keys, features.values, features.lengths)
        out = super().forward(features)
        return {name: JaggedTensor(values=rows.values, lengths=rows.lengths,
                                   weights=features[name].values if self.need_indices else None)
                for name, rows in out.items()}


def torchrec_twin(module: nn.Module, spec: ShardingSpec, plan: Mapping[str, TableSharding] | None = None,
                  path: str = ""):
    """The sharded twin of a TorchRec collection at ``path``, split by shard group size (``wrap.split_twin``)."""
    bags = type(module).__name__ == "EmbeddingBagCollection"
    kind = TorchRecShardedEmbeddingBagCollection if bags else TorchRecShardedEmbeddingCollection
    return split_twin(lambda part_spec, part_plan, siblings: kind(module, part_spec, part_plan, siblings, path),
                      table_configs(module), bags, spec, plan, module.state_dict, path)
