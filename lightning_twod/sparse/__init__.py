"""Sparse compute: the embedding collections, their sharded twins and everything a lookup runs.

* ``modules``: ``EmbeddingBagCollection``, ``EmbeddingCollection`` (base ``TableCollection``) and
  ``EmbeddingTableConfig``, what a user writes (one process, no sharding);
* ``sharding``: per sharding type, which ids each shard receives and how its outputs combine;
* ``input_dist``: the batch's checks, and its ids routed and sent to their owners (``send_ids``);
* ``kernels``: the local shards of one rank, their lookup and row update (torch or FBGEMM);
* ``update_once``: one row update per optimizer step where FBGEMM updates rows inside backward;
* ``optimizers``: ``SparseOptimizerConfig``, SGD, (momentum-scaled) row-wise AdaGrad and the Adam family on rows;
* ``output_dist``: pooled rows or one row per id back home, assembled into each feature's output;
* ``sharded``: ``ShardedCollection`` and its pooled and unpooled twins: plan, slots, kernels,
  weights, and one lookup (input dist -> kernels -> output dist);
* ``wrap``: finds a model's embedding modules and swaps in their twins (``shard_model``);
* ``torchrec_modules``: twins of TorchRec's collections (imports torchrec; loaded only when used);
* ``pipeline``: the next batch's ids sent while this one trains; ``timing``: per-phase wall times.

Imports go to ``core`` and ``distributed``.
"""

from lightning_twod.sparse.modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    EmbeddingTableConfig,
    TableCollection,
)
from lightning_twod.sparse.optimizers import SparseOptimizerConfig

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "EmbeddingTableConfig", "SparseOptimizerConfig",
           "TableCollection"]
