"""``benchmarks/data.py`` end to end on a tiny SYNTHETIC file: reader processes at W = 1 and 2,
with and without a DataLoader worker, for the TSV reader and the prepared format; the report and
its JSON are written and the bytes each rank read are measured (the parts without processes:
``tests/unit/test_criteo_prepared_benchmark.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.processes import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_data_benchmark_tiny_run(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data.py"), "--lines", "6000", "--worlds", "1,2",
                           "--workers", "0,1", "--row-group-size", "500", "--batch", "256", "--build",
                           str(tmp_path / "build"), "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "data.json").read_text())
    cells = {(c["format"], c["world"], c["workers"]): c for c in report["cells"]}
    assert len(cells) == 8 and {c["batches"] for c in cells.values() if c["world"] == 2} == {6000 // 512}
    total = report["meta"]["bytes"]
    for workers in (0, 1):
        assert cells["tsv", 2, workers]["max_bytes_per_rank"] >= total["tsv"], "every TSV rank reads the whole file"
        assert cells["prepared", 2, workers]["max_bytes_per_rank"] < 0.8 * total["prepared"], "a prepared rank, half"
    assert "SYNTHETIC" in (tmp_path / "out" / "data.md").read_text()
