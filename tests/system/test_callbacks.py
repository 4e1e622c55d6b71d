"""The strategy's model summary counts the sharded embedding rows (globally: as many parameters as
the unsharded model has; per rank: the shards it holds), and ``TrafficMonitor`` logs the bytes it
prints through the Trainer's logger; a short DLRM fit on a 2x2 mesh (4 gloo processes posing as
torchrun ranks) on SYNTHETIC data."""

from __future__ import annotations

import csv
import io
import logging

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.model_summary import summarize
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from lightning_twod import TwoDSparseStrategy
from lightning_twod.datasets import SyntheticDataModule
from lightning_twod.models import DLRM
from lightning_twod.strategies.callbacks import TrafficMonitor, TwoDModelSummary
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

ROWS = [50, 30, 20, 9]
STEPS = 3


def make_model() -> DLRM:
    pl.seed_everything(0)
    return DLRM(table_rows=ROWS, embedding_dim=8, num_dense=4, bottom_mlp=[8], top_mlp=[8])


class _TrafficAtStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.bytes = dict(trainer.strategy.traffic())


def _worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    logging.getLogger("lightning.pytorch").addHandler(handler)
    strategy = TwoDSparseStrategy(shard_group_size=2, sharding={"t_cat_0": "row_wise"})
    kwargs = C.trainer_kwargs(STEPS)
    kwargs.update(enable_model_summary=True, logger=CSVLogger(root, name="run", version=0), limit_val_batches=0)
    start = _TrafficAtStart()
    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[start, TrafficMonitor()], **kwargs)
    data = SyntheticDataModule(table_rows=ROWS, num_train=STEPS * world * 8, num_dense=4, batch_size=8)
    trainer.fit(make_model(), data)
    logging.getLogger("lightning.pytorch").removeHandler(handler)
    summaries = [cb for cb in trainer.callbacks if isinstance(cb, TwoDModelSummary)]
    return {"log": text.getvalue(), "summaries": len(summaries), "counts": summaries[0].embedding_counts,
            "traffic": {k: v - start.bytes[k] for k, v in strategy.traffic().items()}, "steps": trainer.global_step}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("callbacks")
    return run_distributed(_worker, C.WORLD, C.free_port(), str(root), timeout=420), root


def test_summary_counts_the_embedding_rows_globally_and_per_rank(run):
    results, _ = run
    unsharded = summarize(make_model())
    tables = sum(ROWS) * 8
    assert unsharded.total_parameters > tables, "the unsharded summary counts the tables"
    assert all(r["summaries"] == 1 for r in results), "the strategy installed its summary in place of Lightning's"
    count = results[0]["counts"]["sparse"]
    assert (count.tables, count.rows, count.params) == (len(ROWS), sum(ROWS), tables)
    assert all(r["counts"]["sparse"] == count for r in results), "every rank has every rank's numbers"
    # shard groups [0, 1] and [2, 3] each hold one full copy; the replicas hold the same shards
    assert count.rank_rows[0] + count.rank_rows[1] == sum(ROWS)
    assert count.rank_rows[:2] == count.rank_rows[2:] and count.rank_params == [8 * n for n in count.rank_rows]
    assert 0 < min(count.rank_rows) < sum(ROWS)
    log = results[0]["log"]
    assert f"{get_human_readable_count(unsharded.total_parameters):<10}Total params" in log, log
    assert f"sparse: 4 tables, {sum(ROWS):,} rows" in log and f"0: {count.rank_rows[0]:,} /" in log
    assert "Embedding rows" not in results[1]["log"], "rank 0 prints the summary"


def test_traffic_monitor_logs_what_it_prints(run):
    results, root = run
    with (root / "run" / "version_0" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("traffic/intra_MB_per_step")]
    assert len(rows) == 1
    logged = {k: float(v) for k, v in rows[0].items() if k.startswith("traffic/") and v}
    steps = results[0]["steps"]
    assert steps == STEPS
    for kind in ("intra", "cross"):
        per_rank = [r["traffic"][kind] / steps / 1e6 for r in results]
        assert min(per_rank) > 0, kind
        assert logged[f"traffic/{kind}_MB_per_step"] == pytest.approx(sum(per_rank) / len(per_rank), rel=1e-6)
        for rank, value in enumerate(per_rank):
            assert logged[f"traffic/rank{rank}/{kind}_MB_per_step"] == pytest.approx(value, rel=1e-6)
    assert logged["traffic/input_dist_MB_per_step"] > 0 and logged["traffic/replica_sync_MB_per_step"] > 0
    means = {"traffic/intra_MB_per_step", "traffic/cross_MB_per_step"}
    by_collective = sum(v for k, v in logged.items() if k.count("/") == 1 and k not in means)  # not per rank
    everything = sum(r["traffic"]["intra"] + r["traffic"]["cross"] for r in results) / steps / 1e6
    assert by_collective == pytest.approx(everything, rel=1e-6), "every byte of training counted once, by collective"
    assert "bytes sent per training step" in results[0]["log"]
