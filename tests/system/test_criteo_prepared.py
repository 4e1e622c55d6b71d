"""Prepared Criteo splits (tiny, made-up rows that the tests write) read by DataLoader worker
processes and by ranks under the 2D strategy: the workers of a rank hand out its batches in the order
``shares.delivery_order`` says, each row once, and a loader resumed mid-epoch with workers goes on
where it stopped; on a 2x2 mesh of 4 gloo processes a shuffled fit runs the same number of steps on
every rank, a fit resumed from a mid-epoch checkpoint trains on the uninterrupted fit's batches, and
the test split is scored once with the padding rule (one process: ``tests/unit/test_criteo_prepared.py``)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_twod import TwoDSparseStrategy
from lightning_twod.datasets.criteo import CriteoDataModule, CriteoTSV
from lightning_twod.datasets.criteo_prepare import prepare_criteo
from lightning_twod.datasets.criteo_prepared import CriteoPrepared
from lightning_twod.datasets.resumable import ResumableLoader
from lightning_twod.datasets.shares import delivery_order
from lightning_twod.models import DLRM
from lightning_twod.strategies.callbacks import PredictionWriter
from tests.helpers import strategy_cases as C
from tests.helpers.criteo_cases import ROWS, batches, criteo_lines, write
from tests.helpers.distributed import run_distributed

TRAIN, TEST, BATCH = 141, 37, 4  # train: 8 global batches of 16, 13 rows left out; test: ranks of 10, 9, 9, 9 rows


def indices(got) -> list[list[int]]:
    return [b["index"].tolist() for b in got]


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    lines = criteo_lines(TRAIN + TEST, seed=4)
    train, test = write(root / "day_0.gz", lines[:TRAIN]), write(root / "day_1", lines[TRAIN:])
    prepare_criteo(train, root / "train", ROWS, row_group_size=6)
    prepare_criteo(test, root / "test", ROWS, row_group_size=6)
    return root


@pytest.mark.parametrize("drop_last", [False, True])
def test_workers_hand_out_a_ranks_batches_in_the_delivery_order(splits, drop_last):
    for rank in range(2):
        alone = batches(CriteoPrepared(splits / "train", ROWS, 5, drop_last, rank, 2))
        got = batches(CriteoPrepared(splits / "train", ROWS, 5, drop_last, rank, 2), workers=3)
        assert indices(got) == [indices(alone)[j] for j in delivery_order(len(alone), 3)]
        assert len(got) == (TRAIN // 10 if drop_last else 15)


def test_a_loader_resumed_with_workers_goes_on_where_it_stopped(splits):
    def loader() -> ResumableLoader:
        return ResumableLoader(CriteoPrepared(splits / "train", ROWS, 3, True, 0, 2, shuffle=True), num_workers=2)

    whole = loader()
    uninterrupted = [indices(whole) for _ in range(2)]
    for stop in (4, 7):
        stopped = loader()
        it = iter(stopped)
        head = [next(it)["index"].tolist() for _ in range(stop)]
        state = stopped.state_dict()
        del it
        resumed = loader()
        resumed.load_state_dict(state)
        assert head + indices(resumed) == uninterrupted[0], f"stopped after {stop}"
        assert indices(resumed) == uninterrupted[1]


class _Seen(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.seen.append(batch["index"].tolist())


def _fit(root: str, saves_to: str, ckpt_path: str | None = None) -> tuple[list[list[int]], int]:
    pl.seed_everything(0)
    data = CriteoDataModule(train_path=f"{root}/train", table_rows=ROWS, batch_size=BATCH, seed=3)
    model = DLRM(table_rows=data.table_rows, num_dense=13, embedding_dim=4, bottom_mlp=[4], top_mlp=[4])
    seen = _Seen()
    saves = ModelCheckpoint(dirpath=saves_to, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(devices=C.WORLD, strategy=TwoDSparseStrategy(shard_group_size=2), callbacks=[seen, saves],
                         **C.trainer_kwargs(-1, max_epochs=2) | {"enable_checkpointing": True})
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return seen.seen, trainer.global_step


def _worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    seen, steps = _fit(root, f"{root}/ckpt")
    resumed, _ = _fit(root, f"{root}/ckpt_resumed", ckpt_path=f"{root}/ckpt/step=3.ckpt")  # after 3 of 8 batches
    writer = PredictionWriter(f"{root}/predictions.pt")
    data = CriteoDataModule(test_path=f"{root}/test", table_rows=ROWS, batch_size=BATCH)
    trainer = pl.Trainer(devices=world, strategy=TwoDSparseStrategy(shard_group_size=2), callbacks=[writer],
                         **C.trainer_kwargs(-1))
    model = DLRM(table_rows=ROWS, num_dense=13, embedding_dim=4, bottom_mlp=[4], top_mlp=[4])
    trainer.test(model, data, verbose=False)
    trainer.predict(model, data, return_predictions=False)
    return {"seen": seen, "steps": steps, "resumed": resumed, "test_batches": trainer.num_test_batches}


def test_a_shuffled_fit_on_a_2x2_mesh_resumes_mid_epoch_and_tests_each_sample_once(splits):
    results = run_distributed(_worker, C.WORLD, C.free_port(), str(splits), timeout=420)
    per_epoch = TRAIN // (BATCH * C.WORLD)
    for r in results:
        assert r["steps"] == 2 * per_epoch and len(r["seen"]) == 2 * per_epoch
        assert r["resumed"] == r["seen"][3:], "the resumed fit trains on the uninterrupted fit's batches"
        assert r["test_batches"] == [3], "ceil(ceil(37 / 4) / 4) batches on every rank"
    for epoch in range(2):
        rows = sorted(i for r in results for b in r["seen"][epoch * per_epoch:(epoch + 1) * per_epoch] for i in b)
        assert len(rows) == len(set(rows)) == per_epoch * BATCH * C.WORLD, "each row at most once an epoch"
    assert results[0]["seen"][:per_epoch] != results[0]["seen"][per_epoch:], "shuffled by epoch"
    written = torch.load(Path(splits) / "predictions.pt")
    tsv = batches(CriteoTSV(Path(splits) / "day_1", ROWS, TEST))[0]
    assert written["index"].tolist() == list(range(TEST)), "each test sample once, padding left out"
    assert torch.equal(written["label"], tsv["label"])
