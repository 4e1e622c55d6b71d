"""Criteo click logs (Kaggle Display Advertising Challenge, Criteo 1TB) streamed from their TSV files.

Format: one sample a line, 40 tab-separated columns: the label (``0``/``1``), ``I1 ... I13``
integer counts (may be empty; some are negative) and ``C1 ... C26`` categorical values in
hexadecimal (e.g. ``68fd1e64``; may be empty). The Kaggle ``train.txt`` and the 1TB set's
``day_N`` files have this format; files ending in ``.gz`` are read through gzip. (Kaggle's
``test.txt`` has no label column and is not accepted.)

Features of a sample:

* ``dense`` ``[B, 13]``: ``log(1 + max(x, 0))`` of each integer, ``0`` when empty;
* ``sparse``: features ``cat_0 ... cat_25`` (one id each, the DLRM's default names), hashed into
  the configured table sizes: ``0`` when empty, else ``int(value, 16) % (rows - 1) + 1``, so id 0
  always means "missing";
* ``label`` ``[B]`` float; ``index`` ``[B]`` int64: the sample's line over the split's files,
  counted from 0 (``-1``: a padding sample, below).

Streaming: nothing is loaded whole. Rank ``r`` of ``W`` (the DataLoader workers ``k`` of ``K`` of
every rank share the rank's work): global batch ``g`` is lines ``[g B W, (g + 1) B W)``; its lines
``i`` with ``i % W == r`` are rank ``r``'s batch ``g``, built by worker ``g % K``. Every reader reads
all lines but parses only its own, so every rank runs the same number of batches, which the
sharded lookups' collectives need: training drops the last, incomplete global batch, evaluation
keeps it, and a rank left without a sample in a batch (at the end of the data, or because all its
rows there were bad and skipped) gets one padding sample with ``index = -1`` that the DLRM's loss,
metrics and predictions leave out.

Every reader reading every line suits small files and quick starts; at scale, convert the files
once into the prepared format (``prepare_criteo``, ``lightning-twod prepare-criteo``), of which each
rank reads only its own row groups (``datasets.criteo_prepared``; ``CriteoDataModule`` takes either).

Bad rows (another number of columns, a label other than 0/1, an integer column that is not an
integer, a categorical column that is not hexadecimal): ``bad_rows="raise"`` (default) raises a
``ValueError`` naming the file, the line and the column; ``bad_rows="skip"`` leaves them out, and
every reader logs at the end of its pass how many it skipped, and the first one.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_twod.core.features import SparseFeatures
from lightning_twod.datasets.sharding import PADDING, rank_and_world

NUM_DENSE, NUM_SPARSE = 13, 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE
FEATURES = [f"cat_{f}" for f in range(NUM_SPARSE)]
FORMAT = "Criteo TSV: label, 13 integer and 26 hexadecimal categorical columns, tab-separated"

log = logging.getLogger(__name__)


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _as_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    found = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not found:
        raise ValueError("no Criteo files given")
    missing = [str(p) for p in found if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Criteo files not found: {missing}")
    return found


class BadRow(ValueError):
    """A line that is not a Criteo sample; the message names the file, the line and the column."""


@dataclass
class _Batch:
    """Parsed samples of one batch, as Python lists until :meth:`tensors`."""

    index: list[int] = field(default_factory=list)
    label: list[float] = field(default_factory=list)
    dense: list[list[float]] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)

    def tensors(self) -> dict[str, Tensor | SparseFeatures]:
        if not self.index:  # one padding sample: every rank runs the batch
            self.index, self.label = [PADDING], [0.0]
            self.dense, self.ids = [[0.0] * NUM_DENSE], [[0] * NUM_SPARSE]
        ids = torch.tensor(self.ids, dtype=torch.int64)  # [B, 26]
        dense = torch.tensor(self.dense, dtype=torch.float64).clamp(min=0).log1p().float()
        sparse = SparseFeatures(FEATURES, ids.t().flatten(), torch.ones(ids.numel(), dtype=torch.int64))
        return {"dense": dense, "sparse": sparse, "label": torch.tensor(self.label),
                "index": torch.tensor(self.index, dtype=torch.int64)}


class CriteoTSV(IterableDataset):
    """The batches of rank ``rank`` of ``world_size`` over Criteo TSV files (see the module doc).

    Args:
        paths: one file or several, read in order as one sequence of lines.
        table_rows: 26 table sizes (``cat_0 ... cat_25``), each at least 2.
        batch_size: samples per rank and batch.
        bad_rows: ``"raise"`` or ``"skip"`` (and count).
        drop_last: leave out the last global batch when it is incomplete (training).
        rank, world_size: this process's data-parallel rank and the number of ranks.

    Use with ``DataLoader(dataset, batch_size=None, num_workers=K)``: it yields whole batches.
    ``skipped`` holds the number of bad rows this object's last pass skipped (in the process that
    ran it: with workers, each worker logs its own count).
    """

    def __init__(self, paths: str | Path | Sequence[str | Path], table_rows: Sequence[int], batch_size: int,
                 bad_rows: Literal["raise", "skip"] = "raise", drop_last: bool = False, rank: int = 0,
                 world_size: int = 1) -> None:
        self.paths = _as_paths(paths)
        self.table_rows = [int(n) for n in table_rows]
        if len(self.table_rows) != NUM_SPARSE or min(self.table_rows) < 2:
            raise ValueError(f"table_rows must be {NUM_SPARSE} sizes of at least 2 rows (row 0 is 'missing'), "
                             f"got {list(table_rows)}")
        if bad_rows not in ("raise", "skip"):
            raise ValueError(f"bad_rows={bad_rows!r}; use 'raise' or 'skip'")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size; got {batch_size}, {rank}, {world_size}")
        self.batch_size, self.bad_rows, self.drop_last = batch_size, bad_rows, drop_last
        self.rank, self.world_size = rank, world_size
        self.skipped = 0

    def _lines(self) -> Iterator[tuple[Path, int, bytes]]:
        """``(file, line number from 1, line)`` of every line of every file, in order."""
        for path in self.paths:
            with _open(path) as file:
                for number, line in enumerate(file, start=1):
                    yield path, number, line

    def _parse(self, path: Path, number: int, line: bytes, index: int, into: _Batch) -> None:
        """Append the sample of ``line`` (sample ``index``) to ``into``; ``BadRow`` if it is not one."""
        columns = line.rstrip(b"\r\n").split(b"\t")
        where = f"{path}:{number}"
        if len(columns) != NUM_COLUMNS:
            raise BadRow(f"{where}: {len(columns)} columns, expected {NUM_COLUMNS} ({FORMAT})")
        if columns[0] not in (b"0", b"1"):
            raise BadRow(f"{where}: column 1 (label) is {columns[0].decode(errors='replace')!r}, expected 0 or 1")
        dense = []
        for c, value in enumerate(columns[1:1 + NUM_DENSE]):
            try:
                dense.append(float(int(value)) if value else 0.0)
            except ValueError:
                raise BadRow(f"{where}: column {c + 2} (I{c + 1}) is {value.decode(errors='replace')!r}, "
                             "not an integer") from None
        ids = []
        for c, (value, rows) in enumerate(zip(columns[1 + NUM_DENSE:], self.table_rows)):
            try:
                ids.append(int(value, 16) % (rows - 1) + 1 if value else 0)
            except ValueError:
                raise BadRow(f"{where}: column {c + 2 + NUM_DENSE} (C{c + 1}) is "
                             f"{value.decode(errors='replace')!r}, not hexadecimal") from None
        into.index.append(index)
        into.label.append(float(columns[0] == b"1"))
        into.dense.append(dense)
        into.ids.append(ids)

    def __iter__(self) -> Iterator[dict[str, Tensor | SparseFeatures]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        block = self.batch_size * self.world_size
        current, batch, lines = -1, _Batch(), 0
        skipped, first_bad = 0, None
        for i, (path, number, line) in enumerate(self._lines()):
            g = i // block
            if g != current:
                if current >= 0 and current % workers == worker:
                    yield batch.tensors()  # global batch `current` is complete
                current, batch = g, _Batch()
            lines = i + 1
            if g % workers != worker or i % self.world_size != self.rank:
                continue
            try:
                self._parse(path, number, line, i, batch)
            except BadRow as bad:
                if self.bad_rows == "raise":
                    raise BadRow(f"{bad}; pass bad_rows='skip' to skip and count such rows") from None
                skipped, first_bad = skipped + 1, first_bad or str(bad)
        complete = lines == (current + 1) * block
        if current >= 0 and current % workers == worker and (complete or not self.drop_last):
            yield batch.tensors()
        self.skipped = skipped
        if skipped:
            log.warning("CriteoTSV: skipped %d bad row(s) of the lines of rank %d, dataloader worker %d of %s "
                        "(first: %s)", skipped, self.rank, worker, [str(p) for p in self.paths], first_bad)


class CriteoDataModule(pl.LightningDataModule):
    """Criteo TSV files (Kaggle or 1TB format; module doc) streamed per rank, or prepared splits
    (``datasets.criteo_prepared``) of which each rank reads its own row groups; nothing is loaded whole.

    Args:
        train_path, val_path, test_path: per split, a TSV file or a list of them (``.gz`` allowed),
            or the directory of a prepared split (``lightning-twod prepare-criteo``); ``val_path=None``:
            no validation.
        predict_path: the files of ``predict`` (default: ``test_path``); they need the label column.
        table_rows: rows of each of the 26 tables, one number for all or a list of 26; the DLRM's
            ``table_rows`` must be the same (``DLRM(table_rows=data.table_rows, num_dense=13)``), and
            a prepared split's (its ids are hashed into them).
        batch_size: samples per rank and batch.
        num_workers: DataLoader workers per rank; they split the rank's batches between them.
        bad_rows: ``"raise"`` (default): a bad row stops with an error naming file and line;
            ``"skip"``: bad rows are left out and counted (each reader logs its count). A prepared
            split was dealt with when it was prepared.
        shuffle, seed: a prepared training split is read in an order of row groups drawn from
            ``(seed, epoch)``, the same on every rank (``shuffle=False``: file order); TSV files are
            read in order.

    A prepared training split's loader saves its place with the checkpoint: a run resumed mid-epoch
    reads the batches the uninterrupted run would have read.
    """

    num_dense = NUM_DENSE

    def __init__(self, train_path: str | list[str] | None = None, val_path: str | list[str] | None = None,
                 test_path: str | list[str] | None = None, predict_path: str | list[str] | None = None,
                 table_rows: int | list[int] = 100_000, batch_size: int = 1024, num_workers: int = 0,
                 bad_rows: Literal["raise", "skip"] = "raise", shuffle: bool = True, seed: int = 0) -> None:
        super().__init__()
        rows = [int(table_rows)] * NUM_SPARSE if isinstance(table_rows, int) else [int(n) for n in table_rows]
        if len(rows) != NUM_SPARSE:
            raise ValueError(f"table_rows: {len(rows)} sizes for the {NUM_SPARSE} categorical columns of Criteo")
        self.table_rows = rows
        given = {"train": train_path, "val": val_path, "test": test_path, "predict": predict_path}
        for stage, paths in given.items():  # checked where the module is made: before any process starts
            if paths is not None:
                try:
                    self._check(paths)
                except (ValueError, FileNotFoundError) as err:
                    raise type(err)(f"CriteoDataModule: {stage}_path: {err}") from None
        self.paths = {**given, "predict": predict_path or test_path}
        self.batch_size, self.num_workers, self.bad_rows = batch_size, num_workers, bad_rows
        self.shuffle, self.seed = shuffle, seed

    def _check(self, paths) -> None:
        from lightning_twod.datasets.criteo_prepared import check_table_rows, read_layout

        if isinstance(paths, (str, Path)) and Path(paths).is_dir():
            check_table_rows(read_layout(paths, footers=False), self.table_rows, "CriteoDataModule")
        else:
            _as_paths(paths)

    def _loader(self, stage: str, drop_last: bool) -> DataLoader:
        from lightning_twod.datasets.criteo_prepared import CriteoPrepared, is_prepared
        from lightning_twod.datasets.resumable import ResumableLoader

        paths = self.paths[stage]
        if paths is None:
            raise ValueError(f"CriteoDataModule: no files for {stage}; set {stage}_path (predict also reads "
                             "test_path) to a Criteo TSV file or a list of them, or a prepared split's directory")
        rank, world = rank_and_world(self.trainer)
        if not is_prepared(paths):
            dataset = CriteoTSV(paths, self.table_rows, self.batch_size, self.bad_rows, drop_last, rank, world)
        elif stage == "train":  # its place goes into the checkpoint
            dataset = CriteoPrepared(paths, self.table_rows, self.batch_size, drop_last, rank, world,
                                     shuffle=self.shuffle, seed=self.seed)
            return ResumableLoader(dataset, self.num_workers, epoch=self._epoch)
        else:  # in file order; a plain DataLoader, which Lightning may rebuild (predict tracks indices)
            dataset = CriteoPrepared(paths, self.table_rows, self.batch_size, drop_last, rank, world)
        return DataLoader(dataset, batch_size=None, num_workers=self.num_workers)

    def _epoch(self) -> int | None:
        return None if self.trainer is None else self.trainer.current_epoch

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", drop_last=True)

    def val_dataloader(self) -> DataLoader | list:
        return [] if self.paths["val"] is None else self._loader("val", drop_last=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", drop_last=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict", drop_last=False)
