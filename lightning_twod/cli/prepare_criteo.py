"""``lightning-twod prepare-criteo TSV... --out DIR --table-rows N``: Criteo TSV days (``.gz`` allowed)
converted once into a prepared split (``datasets.criteo_prepare.prepare_criteo``) that
``CriteoDataModule`` reads with each rank reading its own row groups.

The arguments are parsed before pyarrow and torch are imported, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import time


def _table_rows(text: str) -> int | list[int]:
    """``100000`` (every table) or 26 sizes separated by commas."""
    sizes = [int(n) for n in text.split(",")]
    return sizes[0] if len(sizes) == 1 else sizes


def prepare_criteo_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-twod prepare-criteo",
        description="Convert Criteo TSV files (Kaggle train.txt or the 1TB set's day_N, .gz allowed) of one split "
                    "into Parquet row groups with the ids hashed into the table sizes; give the directory as "
                    "CriteoDataModule's train_path / val_path / test_path. One command per split.")
    parser.add_argument("sources", nargs="+", help="the split's TSV files, in order")
    parser.add_argument("--out", required=True, help="the prepared split's directory (new or empty)")
    parser.add_argument("--table-rows", required=True, type=_table_rows,
                        help="rows of each of the 26 tables: one number, or 26 separated by commas (the data "
                             "module's and the DLRM's table_rows must be the same)")
    parser.add_argument("--bad-rows", choices=("raise", "skip"), default="raise",
                        help="raise (default): stop at the first bad row, naming file, line and column; skip: "
                             "leave bad rows out and count them")
    parser.add_argument("--row-group-size", type=int, default=65_536,
                        help="rows per row group, the unit the ranks split (default 65536; keep the row groups "
                             "at least ~10 per rank)")
    args = parser.parse_args(argv)

    from lightning_twod.datasets.criteo_prepare import prepare_criteo

    began = time.perf_counter()
    layout = prepare_criteo(args.sources, args.out, args.table_rows, args.bad_rows, args.row_group_size)
    rows = sum(f["rows"] for f in layout["files"])
    skipped = sum(f["skipped"] for f in layout["files"])
    print(f"wrote {rows:,} samples of {sum(f['lines'] for f in layout['files']):,} lines ({skipped:,} bad rows "
          f"skipped) from {len(layout['files'])} file(s) to {args.out} in {time.perf_counter() - began:.1f} s")
