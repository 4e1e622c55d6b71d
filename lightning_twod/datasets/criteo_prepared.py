"""Criteo in the prepared format: Parquet row groups that each rank (and each DataLoader worker)
splits, so that a rank reads about ``1 / W`` of the bytes (``CriteoPrepared``).

Layout of a prepared split (``prepare_criteo`` / ``lightning-twod prepare-criteo`` writes it; Spark,
Ray Data or any Parquet writer may too):

* ``_criteo.json``: ``{"format": "lightning-twod/criteo-prepared", "version": 1, "table_rows": [26
  sizes], "files": [{"path": "part-00000.parquet", ...}, ...]}``; the files, relative to the
  directory, are read in this order (``prepare_criteo`` adds each file's source, lines, rows and
  skipped bad rows);
* each file: Parquet, row groups of about the same number of rows (the unit the ranks split; 64 Ki
  rows by default), one row a sample, columns:

  ======================  ==========  =========================================================
  ``index``               int64       the sample's line over the split's TSV files, from 0
  ``label``               int8        0 or 1
  ``I1`` ... ``I13``      float32     ``log(1 + max(x, 0))`` of the integer (0 when empty)
  ``C1`` ... ``C26``      int32/64    ``0`` when empty, else ``int(value, 16) % (rows - 1) + 1``
  ======================  ==========  =========================================================

  (``rows``: the column's table size in ``table_rows``; int64 where a table has 2**31 rows or more.)

A batch is the same dict as ``CriteoTSV``'s: ``dense`` ``[B, 13]`` (the ``I`` columns), ``sparse``
(``cat_0 ... cat_25`` from ``C1 ... C26``), ``label`` ``[B]`` float, ``index`` ``[B]`` int64. Which
rows a rank and a worker read, the shuffle of row groups and the padding: ``datasets.shares``. Bad
rows were dealt with when the split was prepared.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from lightning_twod.core.features import SparseFeatures
from lightning_twod.datasets.criteo import FEATURES, NUM_DENSE, NUM_SPARSE
from lightning_twod.datasets.sharding import PADDING
from lightning_twod.datasets.shares import RankShare, group_order, rank_share, worker_batches

FORMAT, VERSION, LAYOUT = "lightning-twod/criteo-prepared", 1, "_criteo.json"
DENSE = [f"I{c + 1}" for c in range(NUM_DENSE)]
IDS = [f"C{c + 1}" for c in range(NUM_SPARSE)]
COLUMNS = ["index", "label", *DENSE, *IDS]


def id_type(table_rows: list[int]):
    """The Arrow type of the ``C`` columns: int32 while every id fits."""
    import pyarrow as pa

    return pa.int32() if max(table_rows) <= 2**31 else pa.int64()


def schema(ids):
    """The Arrow schema of a prepared file whose ``C`` columns have type ``ids``."""
    import pyarrow as pa

    return pa.schema([("index", pa.int64()), ("label", pa.int8()), *((name, pa.float32()) for name in DENSE),
                      *((name, ids) for name in IDS)])


def is_prepared(path) -> bool:
    """Whether ``path`` is a prepared split's directory (it holds ``_criteo.json``)."""
    return isinstance(path, (str, Path)) and (Path(path) / LAYOUT).is_file()


@dataclass(frozen=True)
class Layout:
    """A prepared split: its table sizes, files, and row groups ``(file, group in file, rows)`` in file order."""

    root: Path
    table_rows: list[int]
    files: list[Path]
    groups: list[tuple[int, int, int]]

    @property
    def rows(self) -> int:
        return sum(n for _, _, n in self.groups)


def read_layout(root: str | Path, footers: bool = True) -> Layout:
    """The layout of the prepared split ``root``; ``footers=False`` leaves the row groups unread."""
    root = Path(root)
    try:
        meta = json.loads((root / LAYOUT).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{root} is not a prepared Criteo split: no {LAYOUT}; write one with "
                                "`lightning-twod prepare-criteo`") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{root / LAYOUT}: format {meta.get('format')!r} version {meta.get('version')!r}; "
                         f"this reader reads {FORMAT!r} version {VERSION}")
    rows = [int(n) for n in meta["table_rows"]]
    if len(rows) != NUM_SPARSE:
        raise ValueError(f"{root / LAYOUT}: table_rows has {len(rows)} sizes, expected {NUM_SPARSE}")
    files = [root / f["path"] for f in meta["files"]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{root / LAYOUT} names files that are not there: {missing}")
    groups = []
    if footers:
        import pyarrow.parquet as pq

        for i, path in enumerate(files):
            meta = pq.ParquetFile(path).metadata
            absent = [c for c in COLUMNS if c not in meta.schema.names]
            if absent:
                raise ValueError(f"{path}: no column(s) {absent}; a prepared Criteo file has {COLUMNS}")
            groups += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    return Layout(root, rows, files, groups)


def batch_tensors(index: np.ndarray, label: np.ndarray, dense: np.ndarray,
                  ids: np.ndarray) -> dict[str, Tensor | SparseFeatures]:
    """A batch from ``index`` [B] int64, ``label`` [B] int8, ``dense`` [B, 13] float32 and ``ids``
    [B, 26] int64; ``B = 0`` gives one padding sample (``index = -1``).

    The batch's tensors are views of one buffer (``OneBufferBatch``), so that a DataLoader worker
    hands it to the rank as one shared-memory block instead of one per tensor.
    """
    if len(index) == 0:
        index, label = np.array([PADDING]), np.zeros(1, np.int8)
        dense, ids = np.zeros((1, NUM_DENSE), np.float32), np.zeros((1, NUM_SPARSE), np.int64)
    batch = OneBufferBatch.of(torch.empty(len(index) * BYTES_PER_SAMPLE, dtype=torch.uint8))
    batch["sparse"].values.view(NUM_SPARSE, -1).numpy()[:] = ids.T  # feature-major, as CriteoTSV's
    batch["index"].numpy()[:] = index
    batch["label"].numpy()[:] = label
    batch["dense"].numpy()[:] = dense
    return batch


#: Bytes of one sample in a ``OneBufferBatch``: 26 int64 ids, the int64 index, the float32 label and 13 dense values.
BYTES_PER_SAMPLE = 8 * NUM_SPARSE + 8 + 4 + 4 * NUM_DENSE


class OneBufferBatch(dict):
    """``{"dense", "sparse", "label", "index"}`` as views of one uint8 ``buffer`` [B * BYTES_PER_SAMPLE]:
    ids [26, B] int64 (feature-major), index [B] int64, label [B] float32, dense [B, 13] float32, in this
    order. Every bag holds one id, so the lengths are not in the buffer.

    Pickled (a DataLoader worker's queue) as the buffer alone, one shared-memory block, and unpickled
    as a plain dict of views of it. A batch whose entries were replaced (not edited in place) since it
    was made is pickled entry by entry.
    """

    buffer: Tensor | None = None
    _made: dict | None = None  # the entries as made from ``buffer``

    @classmethod
    def of(cls, buffer: Tensor) -> OneBufferBatch:
        """The batch whose bytes are ``buffer``."""
        batch = cls(_views(buffer))
        batch.buffer, batch._made = buffer, dict(batch)
        return batch

    def _unchanged(self) -> bool:
        made = self._made
        return made is not None and self.keys() == made.keys() and all(self[k] is v for k, v in made.items())

    def __reduce__(self):
        return (_views, (self.buffer,)) if self._unchanged() else (dict, (dict(self),))

    def __copy__(self) -> OneBufferBatch:
        """The same entries (DataLoader's ``default_convert`` copies a batch before it passes it on)."""
        clone = OneBufferBatch(self)
        clone.buffer, clone._made = self.buffer, self._made
        return clone


def _views(buffer: Tensor) -> dict[str, Tensor | SparseFeatures]:
    """The batch whose bytes are ``buffer`` (``OneBufferBatch``'s layout)."""
    b = buffer.numel() // BYTES_PER_SAMPLE
    ids, index, label, dense = buffer.split([8 * NUM_SPARSE * b, 8 * b, 4 * b, 4 * NUM_DENSE * b])
    values = ids.view(torch.int64)
    sparse = SparseFeatures(FEATURES, values, torch.ones(values.numel(), dtype=torch.int64))
    return {"dense": dense.view(torch.float32).view(b, NUM_DENSE), "sparse": sparse,
            "label": label.view(torch.float32), "index": index.view(torch.int64)}


class CriteoPrepared(IterableDataset):
    """The batches of rank ``rank`` of ``world_size`` over a prepared split (module doc).

    Args:
        root: the split's directory (``_criteo.json`` and its Parquet files).
        table_rows: 26 table sizes; they must be the ones the split was prepared with.
        batch_size: samples per rank and batch.
        drop_last: leave out the last, incomplete global batch (training).
        rank, world_size: this process's data-parallel rank and the number of ranks.
        shuffle: order the row groups by a permutation drawn from ``(seed, epoch)``, the same on
            every rank (rows keep their order inside a group); else file order.

    ``epoch`` and ``start`` (batches of the epoch already handed out) are read when iteration begins:
    ``ResumableLoader`` sets them. Use with ``DataLoader(dataset, batch_size=None, num_workers=K)``.
    ``len()`` is the number of batches every rank runs per epoch.
    """

    def __init__(self, root: str | Path, table_rows: list[int], batch_size: int, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1, shuffle: bool = False, seed: int = 0) -> None:
        self.layout = read_layout(root)
        check_table_rows(self.layout, table_rows, "CriteoPrepared")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size; got {batch_size}, {rank}, {world_size}")
        self.batch_size, self.drop_last, self.rank, self.world_size = batch_size, drop_last, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.start = 0, 0

    def share(self) -> RankShare:
        return rank_share(self.layout.rows, self.world_size, self.rank, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        return self.share().batches

    def __iter__(self) -> Iterator[dict[str, Tensor | SparseFeatures]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        share = self.share()
        mine = worker_batches(share.batches, workers, worker, self.start)
        if not mine:
            return
        order = group_order(len(self.layout.groups), self.shuffle, self.seed, self.epoch)
        rows = _Rows(self.layout, order, share.batch_rows(mine[0])[0], share.batch_rows(mine[-1])[1])
        for j in mine:
            start, stop = share.batch_rows(j)
            yield batch_tensors(*rows.take(stop - start))


class _Rows:
    """Rows ``[start, stop)`` of an epoch's sequence of row groups, read group by group, taken in order."""

    def __init__(self, layout: Layout, order: np.ndarray, start: int, stop: int) -> None:
        import pyarrow.parquet as pq

        sizes = np.array([layout.groups[g][2] for g in order], np.int64)
        ends = np.cumsum(sizes)
        self.layout, self.order, self.ends, self.sizes = layout, order, ends, sizes
        self.next_group = int(np.searchsorted(ends, start, side="right"))
        self.skip = start - int(ends[self.next_group - 1] if self.next_group else 0)  # rows of it before start
        self.left = stop - start
        self.files: dict[int, pq.ParquetFile] = {}
        self.held = [np.empty(0, np.int64), np.empty(0, np.int8), np.empty((0, NUM_DENSE), np.float32),
                     np.empty((0, NUM_SPARSE), np.int64)]  # index [n], label [n], dense [n, 13], ids [n, 26]

    def _read_group(self) -> list[np.ndarray]:
        import pyarrow.parquet as pq

        file, group, _ = self.layout.groups[self.order[self.next_group]]
        if file not in self.files:
            self.files[file] = pq.ParquetFile(self.layout.files[file])
        table = self.files[file].read_row_group(group, columns=COLUMNS)
        n = min(table.num_rows - self.skip, self.left)
        table = table.slice(self.skip, n)
        self.next_group, self.skip, self.left = self.next_group + 1, 0, self.left - n
        column = [c.to_numpy() for c in table.columns]
        return [column[0], column[1], np.stack(column[2:2 + NUM_DENSE], axis=1),
                np.stack(column[2 + NUM_DENSE:], axis=1).astype(np.int64, copy=False)]

    def take(self, n: int) -> list[np.ndarray]:
        """The next ``n`` rows: index [n], label [n], dense [n, 13], ids [n, 26]."""
        while len(self.held[0]) < n:
            self.held = [np.concatenate([a, b]) for a, b in zip(self.held, self._read_group())]
        taken, self.held = [a[:n] for a in self.held], [a[n:] for a in self.held]
        return taken


def check_table_rows(layout: Layout, table_rows: list[int], who: str) -> None:
    """Refuse table sizes other than the prepared split's (its ids were hashed into those)."""
    if list(table_rows) != layout.table_rows:
        raise ValueError(f"{who}: {layout.root} was prepared with table_rows={layout.table_rows}, not "
                         f"{list(table_rows)}: set table_rows to the prepared sizes, or prepare the TSV files "
                         "again with these (`lightning-twod prepare-criteo --table-rows ...`)")
