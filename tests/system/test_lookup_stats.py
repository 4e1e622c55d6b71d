"""``lookup_stats="auto"`` in a fit on 2 gloo processes: rank 0's first training batch gives every rank the
same statistics (each rank here reads data of its own seed, so a rank sampling alone would differ), and
the sampling leaves no trace in the data or the random state (the state right after set-up, and the
first batch trained on, equal those of a fit with ``lookup_stats=None``)."""

from __future__ import annotations

import hashlib
import json
import random

import lightning.pytorch as pl
import torch

import tests.helpers.strategy_cases as C
from lightning_twod import TwoDSparseStrategy
from lightning_twod.models.dlrm import DLRM
from lightning_twod.sparse.wrap import embedding_tables
from lightning_twod.strategies.planning import first_batch, sample_lookup_stats
from tests.helpers.distributed import run_distributed
from tests.helpers.pooled_data import PooledDataModule

WORLD = 2
ROWS = [2000, 500]


class _Record(pl.Callback):
    """What set-up left: the statistics every rank planned on, the random state; and the first batch trained on."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self.stats = trainer.strategy._sampled_stats
        self.rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes() + repr(random.getstate()).encode()).hexdigest()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.first = batch["sparse"].values.tolist()


def _worker(rank: int, world: int, port: int, lookup_stats) -> dict:
    C.as_external_rank(rank, world, port)
    pl.seed_everything(0)
    record = _Record()
    strategy = TwoDSparseStrategy(links="h100", lookup_stats=lookup_stats)  # shard_group_size="auto": by cost
    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[record], **C.trainer_kwargs(1))
    model = DLRM(table_rows=ROWS, num_dense=4, embedding_dim=8, bottom_mlp=[8], top_mlp=[8])
    data = PooledDataModule(ROWS, num_train=256, batch_size=32, seed_per_rank=True)
    tables = embedding_tables(model)
    trainer.fit(model, data)
    own, _ = first_batch(data.train_dataloader())  # this rank's own first batch, after the fit
    return {"stats": record.stats, "rng": record.rng, "first": record.first,
            "own": sample_lookup_stats(tables, own), "steps": trainer.global_step}


def test_rank_0s_sample_reaches_every_rank_and_moves_no_random_state():
    sampled = run_distributed(_worker, WORLD, C.free_port(), "auto", timeout=300)
    plain = run_distributed(_worker, WORLD, C.free_port(), None, timeout=300)
    assert all(r["steps"] == 1 for r in sampled + plain)
    texts = {r["stats"][0] for r in sampled}
    assert len(texts) == 1, "the ranks planned on different statistics"
    shared = json.loads(texts.pop())
    assert shared == sampled[0]["own"]  # rank 0's
    assert sampled[1]["own"] != sampled[0]["own"]  # rank 1, sampling alone, would have planned on others
    assert shared["t_cat_0"]["pooling_factor"] > 5  # bags of 1 to 19 ids
    assert all(r["stats"] == ("", "") for r in plain)  # lookup_stats=None: nothing sampled
    for with_stats, without in zip(sampled, plain):
        assert with_stats["rng"] == without["rng"]
        assert with_stats["first"] == without["first"]
