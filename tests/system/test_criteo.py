"""The Criteo TSV reader on small files that the tests write in the Kaggle / 1TB format (tiny,
made-up rows, not Criteo's data): features against an independent parse, lines sharded over
ranks and dataloader workers (each line once, equal batch counts), gzip and several files, bad
rows raised with file and line or skipped and counted, and a one-process fit / test / predict."""

from __future__ import annotations

import gzip
import logging
import math
import random
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_twod.integration.callbacks import PredictionWriter
from lightning_twod.datasets.criteo import CriteoDataModule, CriteoTSV
from lightning_twod.models import DLRM

ROWS = [7 + 3 * f for f in range(26)]  # 26 small tables of different sizes


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    """``n`` made-up lines in Criteo's format: label, 13 integers (some empty or negative), 26
    8-digit hexadecimal values (some empty)."""
    gen = random.Random(seed)
    lines = []
    for _ in range(n):
        ints = [gen.choice(["", str(gen.randint(-3, -1)), str(gen.randint(0, 5000))]) for _ in range(13)]
        cats = ["" if gen.random() < 0.15 else f"{gen.getrandbits(32):08x}" for _ in range(26)]
        lines.append("\t".join([str(gen.randint(0, 1)), *ints, *cats]))
    return lines


def write(path: Path, lines: list[str]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as file:
        file.write("".join(line + "\n" for line in lines))
    return path


def expected(line: str) -> tuple[float, list[float], list[int]]:
    """Label, dense and ids of one line, computed here without the reader."""
    columns = line.split("\t")
    dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in columns[1:14]]
    ids = [int(v, 16) % (rows - 1) + 1 if v else 0 for v, rows in zip(columns[14:], ROWS)]
    return float(columns[0]), dense, ids


def batches(dataset: CriteoTSV, workers: int = 0) -> list[dict]:
    return list(DataLoader(dataset, batch_size=None, num_workers=workers))


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


@pytest.mark.parametrize("drop_last", [False, True])
def test_lines_are_sharded_over_ranks_and_workers_once_with_equal_batch_counts(tmp_path, drop_last):
    n, batch, world = 50, 4, 3
    path = write(tmp_path / "day_0", criteo_lines(n))
    per_rank = [batches(CriteoTSV(path, ROWS, batch, drop_last=drop_last, rank=r, world_size=world), workers=2)
                for r in range(world)]
    counts = {len(b) for b in per_rank}
    assert counts == {n // (batch * world) if drop_last else math.ceil(n / (batch * world))}
    real = []
    for rank, got in enumerate(per_rank):
        for g, b in enumerate(got):  # the two workers' batches come back in global-batch order
            index = b["index"]
            assert index.numel() >= 1
            if (index < 0).any():
                assert index.tolist() == [-1], "padding: one sample, alone in a batch"
                continue
            assert all(i % world == rank and i // (batch * world) == g for i in index.tolist())
            real += index.tolist()
    covered = (n // (batch * world)) * batch * world if drop_last else n
    assert sorted(real) == list(range(covered)), "each line exactly once"
    if not drop_last:  # 50 = 4 * 12 + 2: rank 2 gets nothing of the last global batch
        assert [per_rank[r][-1]["index"].tolist() for r in range(world)] == [[48], [49], [-1]]


def test_gzip_and_several_files_read_as_one_sequence(tmp_path):
    lines = criteo_lines(21, seed=1)
    whole = batches(CriteoTSV(write(tmp_path / "all.txt", lines), ROWS, 5, rank=1, world_size=2))
    parts = [write(tmp_path / "day_0.gz", lines[:9]), write(tmp_path / "day_1", lines[9:])]
    split = batches(CriteoTSV(parts, ROWS, 5, rank=1, world_size=2))
    assert len(split) == len(whole) == 3
    for a, b in zip(whole, split):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["dense"], b["dense"])
        assert torch.equal(a["sparse"].values, b["sparse"].values) and torch.equal(a["label"], b["label"])


BAD = [
    ("\t".join(["1"] + ["3"] * 13 + ["ab"] * 25), "39 columns, expected 40"),  # Kaggle's test.txt: no label
    ("\t".join(["1", "3", "4", "x7"] + ["3"] * 10 + ["ab"] * 26), "column 4 (I3) is 'x7', not an integer"),
    ("\t".join(["0"] + ["3"] * 13 + ["ab"] * 5 + ["zz"] + ["ab"] * 20), "column 20 (C6) is 'zz', not hexadecimal"),
    ("\t".join(["2"] + ["3"] * 13 + ["ab"] * 26), "column 1 (label) is '2'"),
]


@pytest.mark.parametrize("bad,reason", BAD, ids=["columns", "integer", "hexadecimal", "label"])
def test_a_bad_row_raises_naming_file_line_and_column(tmp_path, bad, reason):
    lines = criteo_lines(12)
    lines[6] = bad
    path = write(tmp_path / "train.txt", lines)
    with pytest.raises(ValueError, match=re.escape(f"train.txt:7: {reason}")) as err:
        batches(CriteoTSV(path, ROWS, 4))
    assert "bad_rows='skip'" in str(err.value)
    with pytest.raises(ValueError, match="train.txt:7: "):  # from a dataloader worker, too
        batches(CriteoTSV(path, ROWS, 4), workers=1)


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
    with pytest.raises(ValueError, match="no files for test; set test_path"):
        CriteoDataModule(train_path="x").test_dataloader()
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
