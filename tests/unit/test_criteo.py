"""The Criteo TSV reader on small files that the tests write in the Kaggle / 1TB format (tiny,
made-up rows, not Criteo's data, ``tests.helpers.criteo_cases``), on one process: features against
an independent parse, gzip and several files, bad rows skipped and counted when asked, the data
module's checks, and a one-process fit / test / predict (worker processes: ``tests/system/test_criteo.py``)."""

from __future__ import annotations

import logging
import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod.datasets.criteo import CriteoDataModule, CriteoTSV
from lightning_twod.models import DLRM
from lightning_twod.strategies.callbacks import PredictionWriter
from tests.helpers.criteo_cases import BAD, ROWS, batches, criteo_lines, write


def expected(line: str) -> tuple[float, list[float], list[int]]:
    """Label, dense and ids of one line, computed here without the reader."""
    columns = line.split("\t")
    dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in columns[1:14]]
    ids = [int(v, 16) % (rows - 1) + 1 if v else 0 for v, rows in zip(columns[14:], ROWS)]
    return float(columns[0]), dense, ids


def test_rows_parse_into_dense_ids_labels_and_line_indices(tmp_path):
    lines = criteo_lines(30)
    path = write(tmp_path / "train.txt", lines)
    got = batches(CriteoTSV(path, ROWS, batch_size=8))
    assert [b["label"].numel() for b in got] == [8, 8, 8, 6]
    index = torch.cat([b["index"] for b in got])
    assert index.tolist() == list(range(30))
    labels, dense, ids = zip(*(expected(line) for line in lines))
    assert torch.cat([b["label"] for b in got]).tolist() == list(labels)
    torch.testing.assert_close(torch.cat([b["dense"] for b in got]), torch.tensor(dense, dtype=torch.float32))
    for b in got:
        sparse = b["sparse"]
        assert sparse.keys == [f"cat_{f}" for f in range(26)] and sparse.batch_size == b["label"].numel()
        sparse.validate({f"cat_{f}": rows for f, rows in enumerate(ROWS)})
    for f in range(26):
        values = torch.cat([b["sparse"][f"cat_{f}"].values for b in got])
        assert values.tolist() == [row[f] for row in ids], f"cat_{f}"
    empty = [line.split("\t")[14] == "" for line in lines]
    assert any(empty) and all((i == 0) == e for i, e in zip((row[0] for row in ids), empty)), "id 0 is 'missing'"
    assert any(int(v) < 0 for line in lines for v in line.split("\t")[1:14] if v), "negative counts are exercised"


def test_gzip_and_several_files_read_as_one_sequence(tmp_path):
    lines = criteo_lines(21, seed=1)
    whole = batches(CriteoTSV(write(tmp_path / "all.txt", lines), ROWS, 5, rank=1, world_size=2))
    parts = [write(tmp_path / "day_0.gz", lines[:9]), write(tmp_path / "day_1", lines[9:])]
    split = batches(CriteoTSV(parts, ROWS, 5, rank=1, world_size=2))
    assert len(split) == len(whole) == 3
    for a, b in zip(whole, split):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["dense"], b["dense"])
        assert torch.equal(a["sparse"].values, b["sparse"].values) and torch.equal(a["label"], b["label"])


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path, caplog):
    lines = criteo_lines(20)
    for i, (bad, _) in zip((3, 4, 17), BAD):
        lines[i] = bad
    path = write(tmp_path / "train.txt", lines)
    dataset = CriteoTSV(path, ROWS, 4, bad_rows="skip")
    with caplog.at_level(logging.WARNING, logger="lightning_twod.datasets.criteo"):
        got = batches(dataset)
    index = torch.cat([b["index"] for b in got]).tolist()
    assert index == [i for i in range(20) if i not in (3, 4, 17)]
    assert dataset.skipped == 3
    assert "skipped 3 bad row(s)" in caplog.text and "train.txt:4: 39 columns" in caplog.text
    # a rank whose every row of a batch is bad still runs that batch, with one padding sample
    lines = criteo_lines(8)
    lines[1] = lines[3] = BAD[0][0]
    got = batches(CriteoTSV(write(tmp_path / "b.txt", lines), ROWS, 2, bad_rows="skip", rank=1, world_size=2))
    assert [b["index"].tolist() for b in got] == [[-1], [5, 7]]


def test_datamodule_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="26 categorical"):
        CriteoDataModule(table_rows=[10] * 25)
    (tmp_path / "train.tsv").touch()
    with pytest.raises(ValueError, match="no files for test; set test_path"):
        CriteoDataModule(train_path=str(tmp_path / "train.tsv")).test_dataloader()
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        CriteoDataModule(train_path=str(tmp_path / "missing.txt")).train_dataloader()


def test_fit_test_and_predict_on_one_process(tmp_path):
    lines = criteo_lines(300, seed=2)
    train, test = write(tmp_path / "train.txt", lines[:200]), write(tmp_path / "test.txt", lines[200:])
    data = CriteoDataModule(train_path=str(train), val_path=str(test), test_path=str(test), table_rows=ROWS,
                            batch_size=32)
    pl.seed_everything(0)
    torch.set_num_threads(1)
    model = DLRM(table_rows=data.table_rows, num_dense=data.num_dense, embedding_dim=8, bottom_mlp=[8], top_mlp=[8])
    writer = PredictionWriter(str(tmp_path / "predictions.pt"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[writer],
                         default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert trainer.global_step == 200 // 32, "the incomplete last training batch is dropped"
    result = trainer.test(model, data, verbose=False)[0]
    labels = [expected(line)[0] for line in lines[200:]]
    assert result["test_ctr"] == pytest.approx(sum(labels) / len(labels), abs=1e-7)
    trainer.predict(model, data, return_predictions=False)
    written = torch.load(tmp_path / "predictions.pt")
    assert written["index"].tolist() == list(range(100)) and written["label"].tolist() == labels
    torch.testing.assert_close(written["probability"], torch.sigmoid(written["logit"]))


def test_a_missing_file_fails_where_the_datamodule_is_made_naming_the_argument(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"CriteoDataModule: val_path: Criteo files not found: \[.*nope.tsv'\]"):
        CriteoDataModule(val_path=str(tmp_path / "nope.tsv"))
