"""``benchmarks/data.py``'s parts that need no process: its SYNTHETIC file is Criteo's format (the
TSV reader and ``prepare_criteo`` read it without a bad row, to the same batches), and its
targets are judged on made-up cells (the script itself runs in ``tests/system/test_criteo_data_benchmark.py``)."""

from __future__ import annotations

import numpy as np
import torch

from lightning_twod.datasets.criteo import CriteoTSV
from lightning_twod.datasets.criteo_prepare import prepare_criteo
from lightning_twod.datasets.criteo_prepared import CriteoPrepared
from tests.helpers.benchmark_scripts import load_benchmark
from tests.helpers.criteo_cases import batches


def test_the_synthetic_file_is_criteo_format_and_prepares_to_the_same_batches(tmp_path):
    data = load_benchmark("data")
    path = tmp_path / "synthetic.tsv"
    data.write_synthetic(path, 3000, chunk=1000)
    lines = path.read_bytes().split(b"\n")
    assert len(lines) == 3001 and lines[-1] == b"" and {line.count(b"\t") for line in lines[:-1]} == {39}
    columns = [line.split(b"\t") for line in lines[:-1]]
    assert any(c[1] == b"" for c in columns) and any(c[1].startswith(b"-") for c in columns), "empty, negative"
    assert any(c[14] == b"" for c in columns) and all(len(c[20]) in (0, 8) for c in columns)
    rows = [data.TABLE_ROWS] * 26
    tsv = batches(CriteoTSV(path, rows, 512))  # raises on a bad row
    prepare_criteo(path, tmp_path / "prepared", rows, row_group_size=300)
    prepared = batches(CriteoPrepared(tmp_path / "prepared", rows, 512))
    assert len(tsv) == len(prepared) == 6
    for a, b in zip(tsv, prepared):
        assert torch.equal(a["dense"], b["dense"]) and torch.equal(a["sparse"].values, b["sparse"].values)


def test_digits_leave_leading_zeros_out_unless_kept():
    data = load_benchmark("data")
    text = data._digits(np.array([0, 7, 10, 999_999]), 6, 10, b"0123456789", keep_zeros=False)
    assert [bytes(row[row != data.EMPTY]) for row in text] == [b"0", b"7", b"10", b"999999"]
    assert bytes(data._digits(np.array([26]), 8, 16, b"0123456789abcdef", keep_zeros=True)[0]) == b"0000001a"


def test_targets_are_judged_per_rank_bytes_and_the_speedup_at_four():
    data = load_benchmark("data")

    def cell(fmt: str, world: int, workers: int, rate: float, read: float) -> dict:
        return {"format": fmt, "world": world, "workers": workers, "samples_per_s": rate, "max_bytes_per_rank": read}

    cells = [cell("tsv", 4, 0, 20.0, 400.0), cell("prepared", 4, 0, 150.0, 26.0),
             cell("tsv", 4, 2, 10.0, 400.0), cell("prepared", 4, 2, 40.0, 24.0), cell("prepared", 1, 0, 9.0, 101.0)]
    verdict = data.judge(cells, {"tsv": 400, "prepared": 100})
    assert verdict["bytes_ratio"] == {"W=4 workers=0": 1.04, "W=4 workers=2": 0.96, "W=1 workers=0": 1.01}
    assert verdict["bytes_within_1.2x"]
    assert verdict["speedup_at_4"] == {"workers=0": 7.5, "workers=2": 4.0}
    assert not verdict["speedup_at_4_at_least_5x"], "workers=2 misses"
