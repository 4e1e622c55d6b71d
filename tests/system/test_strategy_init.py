"""Shards initialized in place (``init_shards="in_place"``) for tables built on the meta device:
no rank ever holds a full table, every replica starts from the same shard, the table's ``init``
is applied, and training runs."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, TwoDSparseStrategy
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

ROW_SCALE = 1000  # 40k, 60k and 24k rows


class FirstLook(Callback):
    """Records, before the first step, whether replica copies agree and the init's bounds hold."""

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        self.report = []
        for module in strategy.sparse_modules.values():
            for shard, weight in module.local_shards():
                copies = [torch.empty_like(weight) for _ in range(strategy.mesh_groups.dims.num_replicas)]
                dist.all_gather(copies, weight.contiguous(), group=strategy.mesh_groups.replica)
                rows = module.table_config(shard.table).num_embeddings
                self.report.append(dict(
                    table=shard.table, same=all(torch.equal(c, copies[0]) for c in copies),
                    within=bool(weight.abs().max() <= 1 / math.sqrt(rows)), spread=float(weight.std()),
                    rows=shard.rows, full_rows=rows,
                ))


def _worker(rank: int, world_size: int, port: int) -> dict:
    C.as_external_rank(rank, world_size, port)
    net = C.make_net("collection")
    net.sparse = EmbeddingBagCollection(
        [EmbeddingTableConfig(name, rows * ROW_SCALE, dim, feats) for name, rows, dim, feats in C.TABLES],
        device="meta",
    )
    lit = C.LitDLRM(net, lr=0.1, num_samples=2 * C.WORLD * C.LOCAL_BATCH, row_scale=ROW_SCALE)
    look = FirstLook()
    strategy = TwoDSparseStrategy(shard_group_size=2, init_shards="in_place", sharding={"t_item": "row_wise"})
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=[look], **C.trainer_kwargs(2))
    trainer.fit(lit)
    return dict(report=look.report, global_step=trainer.global_step)


def test_in_place_initialization_of_meta_tables():
    results = run_distributed(_worker, C.WORLD, C.free_port(), timeout=240)
    seen_tables = set()
    for result in results:
        assert result["global_step"] == 2
        for entry in result["report"]:
            assert entry["same"], f"replicas of {entry['table']} start from different shards"
            assert entry["within"], f"{entry['table']} exceeds the uniform init bound"
            assert entry["spread"] > 0.1 / math.sqrt(entry["full_rows"]), f"{entry['table']} looks uninitialized"
            seen_tables.add(entry["table"])
            if entry["table"] == "t_item":
                assert entry["rows"] == entry["full_rows"] // 2  # row-wise: no rank holds the whole table
    assert seen_tables == {name for name, *_ in C.TABLES}
