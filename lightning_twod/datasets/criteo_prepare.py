"""Criteo TSV days converted once into the prepared format that ranks split (``prepare_criteo``).

The TSV files are parsed by pyarrow's C++ CSV reader and hashed vectorized (numpy), with the same
features and the same bad-row policy as ``CriteoTSV``: a value the vectorized path does not read
(e.g. a hexadecimal value of more than 16 digits) is decided by ``CriteoTSV``'s own parse, and a bad
row's message is the one ``CriteoTSV`` gives (file, line, column). The layout written is described in
``datasets.criteo_prepared`` (and ``docs/cluster.md``); any other writer of that layout works too.

Needs ``pyarrow`` (``pip install lightning-twod[criteo]``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lightning_twod.datasets.criteo import NUM_DENSE, NUM_SPARSE, BadRow, CriteoTSV, _Batch
from lightning_twod.datasets.criteo_prepared import FORMAT, LAYOUT, VERSION, id_type, schema

log = logging.getLogger(__name__)

TSV_COLUMNS = ["label", *(f"I{c + 1}" for c in range(NUM_DENSE)), *(f"C{c + 1}" for c in range(NUM_SPARSE))]
_INTEGER = r"^-?[0-9]{1,18}$"  # what int() reads that fits int64; anything else goes to CriteoTSV's parse
_HEXADECIMAL = r"^[0-9a-fA-F]{1,16}$"  # what fits uint64
_NIBBLE = np.full(256, 0, np.uint64)
for _c in b"0123456789abcdef":
    _NIBBLE[_c] = _NIBBLE[ord(chr(_c).upper())] = int(chr(_c), 16)


def _arrow():
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.csv as csv
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("the prepared Criteo format needs pyarrow: pip install 'lightning-twod[criteo]' "
                          "(or pip install pyarrow)") from None
    return pa, pc, csv, pq


def _mask(array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False).astype(bool)


def _integers(column) -> tuple[np.ndarray, np.ndarray]:
    """``(values [n] float64, odd [n] bool)`` of an ``I`` column: ``float(int(v))``, 0 when empty;
    ``odd`` marks the values left to ``CriteoTSV``'s parse."""
    pa, pc, _, _ = _arrow()
    fast = _mask(pc.match_substring_regex(column, _INTEGER))
    empty = _mask(pc.equal(pc.binary_length(column), 0))
    values = pc.cast(pc.cast(pc.if_else(pa.array(fast), column, b"0"), pa.string()), pa.int64())
    return values.to_numpy().astype(np.float64), ~fast & ~empty


def _hashed(column, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [n] int64, odd [n] bool)`` of a ``C`` column: ``int(v, 16) % (rows - 1) + 1``, 0 when empty."""
    pa, pc, _, _ = _arrow()
    fast = _mask(pc.match_substring_regex(column, _HEXADECIMAL))
    empty = _mask(pc.equal(pc.binary_length(column), 0))
    padded = pc.utf8_lpad(pc.cast(pc.if_else(pa.array(fast), column, b"0"), pa.string()), 16, "0")
    first = int(np.frombuffer(padded.buffers()[1], np.int32)[padded.offset])
    digits = np.frombuffer(padded.buffers()[2], np.uint8)[first:first + 16 * len(padded)].reshape(-1, 16)
    value = np.zeros(len(padded), np.uint64)
    for d in range(16):
        value = (value << np.uint64(4)) | _NIBBLE[digits[:, d]]
    ids = (value % np.uint64(rows - 1) + np.uint64(1)).astype(np.int64)
    ids[~fast] = 0
    return ids, ~fast & ~empty


class _Lines:
    """Line numbers (from 1) of a file's parsed rows, given the lines pyarrow handed to ``invalid``."""

    def __init__(self) -> None:
        self.invalid: list[tuple[int, bytes]] = []  # (line, text) of rows with another number of columns
        self.rows = 0  # rows parsed so far

    def handler(self, row) -> str:
        self.invalid.append((row.number, row.text.encode(errors="replace")))
        return "skip"

    def of_next(self, n: int) -> np.ndarray:
        """Line numbers ``[n]`` of the next ``n`` parsed rows: the q-th row's line is ``q`` plus the
        invalid lines before it (``u_j = s_j - j`` of the sorted invalid lines ``s``)."""
        q = np.arange(self.rows + 1, self.rows + n + 1)
        shifted = np.array([s for s, _ in self.invalid], np.int64) - np.arange(len(self.invalid))
        self.rows += n
        return q + np.searchsorted(shifted, q, side="right")


def prepare_criteo(sources: str | Path | Sequence[str | Path], out: str | Path, table_rows: int | Sequence[int],
                   bad_rows: Literal["raise", "skip"] = "raise", row_group_size: int = 65_536,
                   block_size: int = 16 << 20) -> dict:
    """Convert Criteo TSV files (``.gz`` allowed; read in order as one split) into a prepared
    directory ``out`` (must not exist or be empty) for ``CriteoDataModule`` / ``CriteoPrepared``.

    Args:
        sources: the split's TSV files, in order (the ``index`` of a sample counts lines over them).
        table_rows: one size for the 26 tables or 26 sizes: ids are hashed into them as ``CriteoTSV`` does.
        bad_rows: ``"raise"``: stop at the first bad row naming file, line and column; ``"skip"``:
            leave bad rows out, count them (in the returned summary, the layout file and a warning).
        row_group_size: rows per Parquet row group, the unit that ranks split (the last of a file is smaller).

    Returns the summary written to ``out/_criteo.json`` (files, lines, rows, skipped rows).
    """
    _, _, _, pq = _arrow()
    rows = [int(table_rows)] * NUM_SPARSE if isinstance(table_rows, int) else [int(n) for n in table_rows]
    tsv = CriteoTSV(sources, rows, batch_size=1, bad_rows=bad_rows)  # checks the files and the sizes
    if row_group_size < 1:
        raise ValueError(f"row_group_size={row_group_size}; it must be at least 1")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"prepare_criteo: {out} exists and is not an empty directory; choose a new one")
    out.mkdir(parents=True, exist_ok=True)
    table_schema = schema(id_type(rows))
    files, offset = [], 0
    for number, path in enumerate(tsv.paths):
        name = f"part-{number:05d}.parquet"
        # no statistics: nothing filters on them, and the footer every reader reads stays small
        with pq.ParquetWriter(out / name, table_schema, compression="zstd", write_statistics=False) as writer:
            lines, skipped = _prepare_file(tsv, path, writer, offset, row_group_size, block_size)
        files.append({"path": name, "source": str(path), "lines": lines,
                      "rows": pq.ParquetFile(out / name).metadata.num_rows, "skipped": skipped})
        offset += lines
    layout = {"format": FORMAT, "version": VERSION, "table_rows": rows, "files": files, "bad_rows": bad_rows,
              "row_group_size": row_group_size}
    (out / LAYOUT).write_text(json.dumps(layout, indent=1) + "\n")
    return layout


def _prepare_file(tsv: CriteoTSV, path: Path, writer, offset: int, row_group_size: int,
                  block_size: int) -> tuple[int, int]:
    """Write the good rows of ``path`` (its first line is sample ``offset``) in row groups of
    ``row_group_size``; return its number of lines and of bad rows skipped."""
    pa, _, csv, _ = _arrow()
    lines, bad = _Lines(), _BadRows(tsv, path)
    read = csv.open_csv(
        pa.input_stream(str(path), compression="gzip" if path.suffix == ".gz" else None),
        read_options=csv.ReadOptions(column_names=TSV_COLUMNS, block_size=block_size, use_threads=False),
        parse_options=csv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False,
                                       invalid_row_handler=lines.handler),
        convert_options=csv.ConvertOptions(column_types=dict.fromkeys(TSV_COLUMNS, pa.binary()),
                                           strings_can_be_null=False, quoted_strings_can_be_null=False))
    pending, judged = [], 0  # judged: invalid lines (another number of columns) already judged
    for batch in read:
        line = lines.of_next(batch.num_rows)
        table, refused = _convert(batch, tsv.table_rows, line, offset, tsv, path)
        before = [t for t in lines.invalid[judged:] if len(line) and t[0] < line[-1]]
        judged += len(before)
        bad.judge(before + refused)
        pending.append(pa.table(table, schema=writer.schema))
        pending = _write_full_groups(pending, writer, row_group_size)
    bad.judge(lines.invalid[judged:])
    if pending:
        writer.write_table(pa.concat_tables(pending), row_group_size=row_group_size)
    if bad.skipped:
        log.warning("prepare_criteo: skipped %d bad row(s) of %s (first: %s)", bad.skipped, path, bad.first)
    return lines.rows + len(lines.invalid), bad.skipped


class _BadRows:
    """The bad-row policy of ``tsv`` on the lines ``(line, text)`` of ``path`` it refuses: raise at
    the first (``CriteoTSV``'s message), or count them."""

    def __init__(self, tsv: CriteoTSV, path: Path) -> None:
        self.tsv, self.path, self.skipped, self.first = tsv, path, 0, None

    def judge(self, bad_lines: list[tuple[int, bytes]]) -> None:
        for line, text in sorted(bad_lines):
            try:
                self.tsv._parse(self.path, line, text, 0, _Batch())
            except BadRow as bad:
                if self.tsv.bad_rows == "raise":
                    raise BadRow(f"{bad}; pass bad_rows='skip' (prepare-criteo --bad-rows skip) to skip and count "
                                 "such rows") from None
                self.skipped, self.first = self.skipped + 1, self.first or str(bad)


def _convert(batch, rows: list[int], line: np.ndarray, offset: int, tsv: CriteoTSV, path: Path):
    """The prepared columns of one parsed block's good rows (``line`` [n]: each row's line number in
    ``path``), and ``(line, text)`` of the rows ``CriteoTSV``'s parse refuses."""
    _, pc, _, _ = _arrow()
    label = batch.column(0)
    ones = _mask(pc.equal(label, b"1"))
    odd = ~(ones | _mask(pc.equal(label, b"0")))
    dense = np.empty((batch.num_rows, NUM_DENSE), np.float64)
    for c in range(NUM_DENSE):
        dense[:, c], odd_c = _integers(batch.column(1 + c))
        odd |= odd_c
    ids = np.empty((NUM_SPARSE, batch.num_rows), np.int64)
    for c, n in enumerate(rows):
        ids[c], odd_c = _hashed(batch.column(1 + NUM_DENSE + c), n)
        odd |= odd_c
    bad, keep = [], np.ones(batch.num_rows, bool)
    for i in np.flatnonzero(odd):  # values the vectorized path leaves to CriteoTSV: it decides, and computes
        values = [batch.column(c)[i].as_py() for c in range(batch.num_columns)]
        text = b"" if not any(values) else b"\t".join(values)  # an empty line: pyarrow gives 40 empty values
        one = _Batch()
        try:
            tsv._parse(path, int(line[i]), text, 0, one)
        except BadRow:
            bad.append((int(line[i]), text))
            keep[i] = False
            continue
        ones[i], dense[i], ids[:, i] = one.label[0] == 1.0, one.dense[0], one.ids[0]
    features = torch.from_numpy(dense[keep]).clamp(min=0).log1p().float().numpy()  # as CriteoTSV computes them
    table = {"index": offset + line[keep] - 1, "label": ones[keep].astype(np.int8)}
    table |= {f"I{c + 1}": features[:, c] for c in range(NUM_DENSE)}
    table |= {f"C{c + 1}": ids[c, keep] for c in range(NUM_SPARSE)}
    return table, bad


def _write_full_groups(pending: list, writer, size: int) -> list:
    """Write every full row group of ``pending`` (tables); return the rest."""
    pa, _, _, _ = _arrow()
    held = sum(t.num_rows for t in pending)
    if held < size:
        return pending
    table = pa.concat_tables(pending).combine_chunks()
    full = held // size * size
    writer.write_table(table.slice(0, full), row_group_size=size)
    return [table.slice(full)] if full < held else []
