"""Data-parallel: small tables copied to every rank and looked up locally, with no all-to-all.

Their gradients come from the local batch only, so the training loop must average them over
the whole world (not only the replica axis), as DDP does for dense parameters.
"""

from __future__ import annotations

from torch import Tensor

from lightning_twod.core.shards import ShardingType
from lightning_twod.sparse.sharding.base import Routed, ShardingScheme


class DataParallel(ShardingScheme):
    type = ShardingType.DATA_PARALLEL

    def combine_sequence(self, pieces: list[Tensor], routed: list[Routed], num_ids: int) -> Tensor:
        return pieces[0]
