"""The Criteo TSV reader with dataloader worker processes: lines sharded over ranks and workers (each
line once, equal batch counts), and a bad row raised naming file, line and column from a worker
(the reader on one process: ``tests/unit/test_criteo.py``)."""

from __future__ import annotations

import math
import re

import pytest

from lightning_twod.datasets.criteo import CriteoTSV
from tests.helpers.criteo_cases import BAD, ROWS, batches, criteo_lines, write


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
