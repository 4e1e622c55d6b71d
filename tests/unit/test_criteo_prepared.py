"""The prepared Criteo format on small files the tests write (tiny, made-up rows, ``tests.helpers.criteo_cases``),
on one process: the same batches as the TSV reader bit for bit, the same bad-row policy and messages,
each rank reading its own row groups with equal batch counts and the padding rule, the shuffle of
row groups, and the position that a resumed loader continues from (DataLoader workers and ranks as
processes: ``tests/system/test_criteo_prepared.py``)."""

from __future__ import annotations

import json
import re
from multiprocessing.reduction import ForkingPickler

import lightning.pytorch as pl
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data._utils.collate import default_convert

from lightning_twod.cli.main import main
from lightning_twod.datasets.criteo import CriteoDataModule, CriteoTSV
from lightning_twod.datasets.criteo_prepare import prepare_criteo
from lightning_twod.datasets.criteo_prepared import LAYOUT, CriteoPrepared
from lightning_twod.datasets.resumable import ResumableLoader
from lightning_twod.datasets.shares import delivery_order, rank_share, worker_batches
from lightning_twod.models import DLRM
from tests.helpers.criteo_cases import BAD, ROWS, batches, criteo_lines, write

#: Lines whose values the vectorized parse leaves to CriteoTSV's (int() and int(x, 16) read them).
ODD = ["\t".join(["1"] + ["+12"] * 13 + ["0x1f"] * 26),
       "\t".join(["0"] + ["1_000"] * 13 + ["1234567890abcdef12"] * 26)]


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for key in ("index", "label", "dense"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        assert a["sparse"].keys == b["sparse"].keys
        assert torch.equal(a["sparse"].values, b["sparse"].values)
        assert torch.equal(a["sparse"].lengths, b["sparse"].lengths)


def indices(got: list[dict]) -> list[list[int]]:
    return [b["index"].tolist() for b in got]


def samples(got: list[dict]) -> dict[int, tuple]:
    """``{index: (label, dense, ids)}`` of the real samples of ``got``."""
    found = {}
    for b in got:
        ids = b["sparse"].values.reshape(26, -1).t()
        for i, index in enumerate(b["index"].tolist()):
            if index >= 0:
                found[index] = (b["label"][i].item(), b["dense"][i].tolist(), ids[i].tolist())
    return found


@pytest.fixture
def split(tmp_path):
    """103 lines over a gzip file and a plain one, prepared in row groups of 7 rows."""
    lines = criteo_lines(103, seed=3)
    lines[7], lines[60] = ODD
    files = [write(tmp_path / "day_0.gz", lines[:40]), write(tmp_path / "day_1", lines[40:])]
    prepare_criteo(files, tmp_path / "prepared", ROWS, row_group_size=7, block_size=1 << 10)
    return files, tmp_path / "prepared"


@pytest.mark.parametrize("drop_last", [False, True])
def test_prepared_batches_equal_the_tsv_batches_bit_for_bit(split, drop_last):
    files, prepared = split
    assert_same_batches(batches(CriteoPrepared(prepared, ROWS, 5, drop_last=drop_last)),
                        batches(CriteoTSV(files, ROWS, 5, drop_last=drop_last)))


def test_a_batch_crosses_from_a_worker_as_one_block_unless_an_entry_was_replaced(split):
    _, prepared = split
    batch = next(iter(CriteoPrepared(prepared, ROWS, 5)))
    got = ForkingPickler.loads(ForkingPickler.dumps(default_convert(batch)))  # a DataLoader worker's queue
    assert type(got) is dict
    assert_same_batches([got], [batch])
    tensors = (got["index"], got["label"], got["dense"], got["sparse"].values)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, "one shared block, not one per tensor"
    batch["label"] = batch["label"] + 1  # a dataset wrapping this one replaced an entry
    batch["weight"] = torch.ones(5)
    edited = ForkingPickler.loads(ForkingPickler.dumps(default_convert(batch)))
    assert torch.equal(edited["label"], got["label"] + 1) and torch.equal(edited["weight"], torch.ones(5))
    assert_same_batches([{**edited, "label": got["label"]}], [got])


def test_layout_file_and_columns(split):
    _, prepared = split
    layout = json.loads((prepared / LAYOUT).read_text())
    assert layout["table_rows"] == ROWS and [f["lines"] for f in layout["files"]] == [40, 63]
    meta = pq.ParquetFile(prepared / "part-00001.parquet").metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [7] * 9
    types = {f.name: str(f.type) for f in pq.read_schema(prepared / "part-00000.parquet")}
    assert types["index"] == "int64" and types["label"] == "int8"
    assert types["I13"] == "float" and types["C26"] == "int32"


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_read_their_own_rows_once_with_equal_batch_counts(split, drop_last):
    files, prepared = split
    world, batch = 3, 4  # 103 = 3 * 34 + 1 rows
    tsv = samples(batches(CriteoTSV(files, ROWS, 7)))
    per_rank = [batches(CriteoPrepared(prepared, ROWS, batch, drop_last, rank, world)) for rank in range(world)]
    assert {len(got) for got in per_rank} == {103 // (batch * world) if drop_last else 9}
    rows = [i for got in per_rank for b in got for i in b["index"].tolist() if i >= 0]
    assert sorted(rows) == rows == list(range(96 if drop_last else 103)), "each row once, ranks in order"
    assert all(tsv[i] == sample for got in per_rank for i, sample in samples(got).items()), "the same features"
    if not drop_last:  # ranks of 35, 34, 34 rows: 9 batches each, the last with 3, 2 and 2 samples
        assert [len(got[-1]["index"]) for got in per_rank] == [3, 2, 2]
        assert indices(batches(CriteoPrepared(prepared, ROWS, 17, False, 1, 3)))[-1] == [-1], "34 rows, 3 batches"


def test_a_rank_reads_only_the_row_groups_of_its_rows(split, monkeypatch):
    _, prepared = split
    read = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, g, **kw: read.append(g) or real(self, g, **kw))
    for rank in range(3):
        read.clear()
        got = batches(CriteoPrepared(prepared, ROWS, 4, True, rank, 3))
        rows = sum(len(b["index"]) for b in got)
        assert rows == 32 and len(read) <= rows // 7 + 2  # its 32 rows lie in at most 6 groups of 7


def test_bad_rows_raise_with_the_tsv_message_or_are_skipped_and_counted(tmp_path, caplog):
    for n, (bad, reason) in enumerate([*BAD, ("", "1 columns, expected 40")]):
        lines = criteo_lines(30)
        lines[12] = bad
        path = write(tmp_path / f"day_{n}", lines)
        with pytest.raises(ValueError, match=re.escape(f"day_{n}:13: {reason}")) as err:
            prepare_criteo(path, tmp_path / f"out_{n}", ROWS, block_size=1 << 10)
        assert "bad_rows='skip'" in str(err.value)
        with pytest.raises(ValueError, match=re.escape(f"day_{n}:13: {reason}")):
            batches(CriteoTSV(path, ROWS, 4))  # the TSV reader says the same
    lines = criteo_lines(30)
    for i, (bad, _) in zip((3, 4, 17), BAD):
        lines[i] = bad
    lines[25] = ""
    layout = prepare_criteo(write(tmp_path / "train.txt", lines), tmp_path / "skipped", ROWS, bad_rows="skip",
                            row_group_size=4, block_size=1 << 9)
    assert layout["files"][0] | {"source": None} == {"path": "part-00000.parquet", "source": None, "lines": 30,
                                                      "rows": 26, "skipped": 4}
    assert "skipped 4 bad row(s)" in caplog.text and "train.txt:4: 39 columns" in caplog.text
    got = batches(CriteoPrepared(tmp_path / "skipped", ROWS, 8))
    assert [i for b in got for i in b["index"].tolist()] == [i for i in range(30) if i not in (3, 4, 17, 25)]


def test_row_groups_are_shuffled_by_seed_and_epoch_the_same_on_every_rank(split):
    _, prepared = split

    def epoch(seed: int, number: int, rank: int) -> list[int]:
        data = CriteoPrepared(prepared, ROWS, 4, True, rank, 2, shuffle=True, seed=seed)
        data.epoch = number
        return [i for b in batches(data) for i in b["index"].tolist()]

    first = [epoch(0, 0, r) for r in range(2)]
    assert not set(first[0]) & set(first[1]) and len(first[0]) == len(first[1]) == 48
    assert first[0] + first[1] != sorted(first[0] + first[1]), "shuffled"
    assert first == [epoch(0, 0, r) for r in range(2)], "the same for the same seed and epoch"
    assert first != [epoch(0, 1, r) for r in range(2)] and first != [epoch(1, 0, r) for r in range(2)]


@pytest.mark.parametrize("batches_per_rank", range(0, 12))
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_workers_split_a_ranks_batches_and_a_resumed_loader_goes_on_in_order(batches_per_rank, workers):
    order = delivery_order(batches_per_rank, workers)
    assert sorted(order) == list(range(batches_per_rank))
    for delivered in range(batches_per_rank + 1):
        # the DataLoader's round robin over its workers, each skipping the ones that have ended
        parts = [list(worker_batches(batches_per_rank, workers, w, delivered)) for w in range(workers)]
        resumed = [p[i] for i in range(max(map(len, parts))) for p in parts if i < len(p)]
        assert resumed == order[delivered:]


def test_eval_shares_pad_like_the_eval_sampler():
    shares = [rank_share(10, 4, r, 2, drop_last=False) for r in range(4)]
    assert [(s.first, s.rows, s.batches) for s in shares] == [(0, 3, 2), (3, 3, 2), (6, 2, 2), (8, 2, 2)]
    assert shares[2].batch_rows(1) == (8, 8), "an empty batch: one padding sample"


def test_a_resumed_loader_reads_the_batches_the_uninterrupted_one_would(split):
    _, prepared = split

    def loader() -> ResumableLoader:
        return ResumableLoader(CriteoPrepared(prepared, ROWS, 4, True, 1, 2, shuffle=True, seed=5))

    whole = loader()
    uninterrupted = [indices(list(whole)) for _ in range(2)]
    assert uninterrupted[0] != uninterrupted[1] and len(uninterrupted[0]) == 12
    stopped = loader()
    it = iter(stopped)
    head = [next(it)["index"].tolist() for _ in range(5)]
    state = stopped.state_dict()
    assert state | {"seed": None} == {"epoch": 0, "batches": 5, "world_size": 2, "num_workers": 0,
                                      "batch_size": 4, "shuffle": True, "seed": None}
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + indices(list(resumed)) == uninterrupted[0]
    assert indices(list(resumed)) == uninterrupted[1], "the next epoch follows"
    other = ResumableLoader(CriteoPrepared(prepared, ROWS, 4, True, 1, 2, shuffle=True, seed=6))
    with pytest.raises(ValueError, match=r"seed=5 then, 6 now.*same settings"):
        other.load_state_dict(state)


def test_datamodule_reads_prepared_splits_and_checks_them(split, tmp_path):
    files, prepared = split
    data = CriteoDataModule(train_path=str(prepared), val_path=str(prepared), table_rows=ROWS, batch_size=5,
                            shuffle=False)
    assert isinstance(data.train_dataloader(), ResumableLoader)
    assert_same_batches(list(data.val_dataloader()), batches(CriteoTSV(files, ROWS, 5)))
    with pytest.raises(ValueError, match=r"train_path: .*prepared with table_rows=\[7, 10, .*set table_rows to the "
                                         r"prepared sizes, or prepare"):
        CriteoDataModule(train_path=str(prepared), table_rows=100)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"val_path: .*empty is not a prepared Criteo split.*prepare-criteo"):
        CriteoDataModule(val_path=str(tmp_path / "empty"), table_rows=ROWS)
    table = pq.read_table(prepared / "part-00000.parquet").drop_columns(["C3"])
    (tmp_path / "spark").mkdir()
    pq.write_table(table, tmp_path / "spark" / "part-0.parquet")
    layout = {"format": "lightning-twod/criteo-prepared", "version": 1, "table_rows": ROWS,
              "files": [{"path": "part-0.parquet"}]}
    (tmp_path / "spark" / LAYOUT).write_text(json.dumps(layout))
    with pytest.raises(ValueError, match=r"part-0.parquet: no column\(s\) \['C3'\]"):
        CriteoDataModule(train_path=str(tmp_path / "spark"), table_rows=ROWS).train_dataloader()


def test_prepare_criteo_command(tmp_path, capsys):
    lines = criteo_lines(20)
    path = write(tmp_path / "day_0", lines)
    with pytest.raises(SystemExit) as done:
        main(["prepare-criteo", str(path), "--out", str(tmp_path / "out"), "--table-rows",
              ",".join(map(str, ROWS)), "--row-group-size", "8"])
    assert done.value.code in (0, None) and "wrote 20 samples of 20 lines (0 bad rows skipped)" in capsys.readouterr().out
    assert_same_batches(batches(CriteoPrepared(tmp_path / "out", ROWS, 6)), batches(CriteoTSV(path, ROWS, 6)))
    lines[4] = BAD[2][0]
    write(path, lines)
    with pytest.raises(SystemExit) as done:
        main(["prepare-criteo", str(path), "--out", str(tmp_path / "bad"), "--table-rows", "100"])
    err = capsys.readouterr().err
    assert done.value.code == 1 and "prepare-criteo: error: " in err and "day_0:5: column 20 (C6)" in err


class _Seen(pl.Callback):
    """The ``index`` of every training batch, in order."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.seen.append(batch["index"].tolist())


@pytest.mark.parametrize("step", [10, 33])  # in the first epoch of 25 batches, and in the second
def test_a_fit_resumed_mid_epoch_trains_on_the_batches_of_the_uninterrupted_fit(split, tmp_path, step):
    _, prepared = split

    def fit(ckpt_path=None) -> list[list[int]]:
        pl.seed_everything(0)
        data = CriteoDataModule(train_path=str(prepared), table_rows=ROWS, batch_size=4, shuffle=True, seed=1)
        model = DLRM(table_rows=data.table_rows, num_dense=13, embedding_dim=4, bottom_mlp=[4], top_mlp=[4])
        seen = _Seen()
        saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=step, save_top_k=-1)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[seen, saves], default_root_dir=tmp_path)
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return seen.seen

    uninterrupted = fit()
    assert len(uninterrupted) == 50 and uninterrupted[:25] != uninterrupted[25:], "two epochs, shuffled"
    assert fit(tmp_path / f"step={step}.ckpt") == uninterrupted[step:]
