"""What a plan costs each shard position: tables, shards, rows, predicted memory and load (``PlanReport``).

Also the links of a layout's shard group, which both the partitioner and the report price the
all-to-all with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_twod.core.mesh import group_shapes
from lightning_twod.core.shards import TableSharding
from lightning_twod.planner.cost import (
    ZERO_STORAGE,
    GroupLinks,
    RankLoad,
    TableSpec,
    Workload,
    predict_load,
    predict_storage,
)
from lightning_twod.planner.links import LinkModel, resolve_links
from lightning_twod.planner.plan import PlanReport, RankReport


def evaluate(specs_by_module: Mapping[str, Sequence[TableSpec]], modules: Mapping[str, Mapping[str, TableSharding]],
             group_size: int, workload: Workload, links: LinkModel | str | None = None,
             group_links: GroupLinks | None = None) -> PlanReport:
    """Per shard position: tables, shards, rows, predicted memory and load of a plan."""
    links = resolve_links(links)
    group_links = group_links or GroupLinks.for_group(links, group_size, group_size)
    storage = [ZERO_STORAGE] * group_size
    load = [RankLoad()] * group_size
    tables: list[list[str]] = [[] for _ in range(group_size)]
    shards, rows = [0] * group_size, [0] * group_size
    for module, specs in specs_by_module.items():
        plan = modules[module]
        for p, (st, ld) in enumerate(zip(predict_storage(specs, plan, group_size, workload),
                                         predict_load(specs, plan, group_size, workload, links, group_links),
                                         strict=True)):
            storage[p] = storage[p] + st
            load[p] = load[p] + ld
        for spec in specs:
            ts = plan[spec.name]
            tag = {"table_wise": "", "row_wise": "[rw]", "column_wise": "[cw]", "data_parallel": "[dp]"}
            for sh in ts.shards:
                for p in (range(group_size) if sh.owner < 0 else [sh.owner]):
                    label = spec.name + tag[ts.sharding_type.value]
                    if label not in tables[p]:
                        tables[p].append(label)
                    shards[p] += 1
                    rows[p] += sh.rows
    return PlanReport(tuple(RankReport(p, tuple(tables[p]), shards[p], rows[p], storage[p], load[p])
                            for p in range(group_size)), workload.batch_size, links.name)


def shard_group_links(links: LinkModel, world_size: int, group_size: int, placement: str,
                      ranks_per_node: int | None) -> GroupLinks:
    """A shard group's all-to-all links: the node's for the members on it, the network for the rest."""
    shard_group = group_shapes(world_size, group_size, placement, ranks_per_node)[0]
    return GroupLinks.for_group(links, group_size, shard_group.local)
