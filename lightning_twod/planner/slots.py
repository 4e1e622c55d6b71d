"""A plan's shards as each shard position reads them: its slots (one feature reading one shard,
``core.shards.assign_slots``: what ``sparse.sharded`` runs), each with its table's ``TableSpec``.

The estimators (``traffic``, ``reduction``, ``storage``) count bytes over these slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_twod.core.shards import Shard, TableSharding, assign_slots
from lightning_twod.planner.inputs import TableSpec


@dataclass(frozen=True)
class Slot:
    """One feature of ``spec`` reading ``shard``; ``fraction``: the share of its lookups on the shard's rows."""

    spec: TableSpec
    shard: Shard

    @property
    def fraction(self) -> float:
        return self.spec.access_fraction(self.shard.row_start, self.shard.row_end)


def owner_slots(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int
                ) -> tuple[list[list[Slot]], list[Slot]]:
    """Per owner position its slots (``core.shards.assign_slots``: what ``sparse.sharded`` runs), with
    their tables' specs; plus the data-parallel slots."""
    by_name = {spec.name: spec for spec in specs}
    owned, local = assign_slots([(spec.name, range(spec.features)) for spec in specs], plan, group_size)
    return ([[Slot(by_name[s.shard.table], s.shard) for s in slots] for slots in owned],
            [Slot(by_name[s.shard.table], s.shard) for s in local])


def unique_shards(slots: Sequence[Slot]) -> list[Slot]:
    """One slot per shard (the features of a shared table read the same shard)."""
    return list({(s.spec.name, s.shard): s for s in slots}.values())


def returned_elements(slots: Sequence[Slot], batch: int) -> float:
    """Elements an owner returns to one peer with ``batch`` samples: pooled rows or one row per id."""
    if not slots:
        return 0.0
    if slots[0].spec.pooled:
        return batch * sum(sl.shard.dim for sl in slots)
    return sum(batch * sl.spec.pooling_factor * sl.fraction * sl.shard.dim for sl in slots)
