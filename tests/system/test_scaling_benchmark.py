"""The scaling benchmark's harness (benchmarks/scaling.py) works: a ``--quick`` run of a few cells on
the two-node testbed writes every field, with positive numbers, and bf16 rounds carry half the
bytes of fp32 ones. Nothing is timed against a bound. Needs root (skipped with the testbed's
reason otherwise); the TorchRec cell needs benchmarks/.venv-torchrec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import testbed

ROOT = Path(__file__).resolve().parents[2]
SCALING = ROOT / "benchmarks" / "scaling.py"
OVERLAP = ROOT / "benchmarks" / "overlap.py"
TORCHREC_VENV = ROOT / "benchmarks" / ".venv-torchrec"
TWOD_CELLS = ["twod 1x4", "twod 2x2c k2 overlap bf16", "twod 2x2c k2 overlap fp32", "twod 2x2c k2 blocking bf16"]
BOUND_CELL = "bound 2x2c no reduction"
TORCHREC_CELL = "torchrec dmp 1d"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> dict:
    try:
        testbed.preflight()
    except testbed.TestbedUnavailable as error:
        pytest.skip(str(error))
    tmp = tmp_path_factory.mktemp("scaling")
    cells = [f"^{name}$" for name in TWOD_CELLS + [BOUND_CELL, TORCHREC_CELL]]
    done = subprocess.run([sys.executable, str(SCALING), "--quick", "--rounds", "1", "--rates", "unshaped",
                           "--workloads", "criteo", "--cells", *cells, "--out-dir", str(tmp / "out"),
                           "--work-dir", str(tmp / "work")], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    data = json.loads((tmp / "out" / "scaling.json").read_text())
    data["_out"], data["_work"] = tmp / "out", tmp / "work"
    return data


def _summary(data: dict) -> dict:
    return data["results"]["criteo"]["unshaped"]["summary"]


def test_twod_cells_report_every_field(quick_run):
    summary = _summary(quick_run)
    for name in TWOD_CELLS:
        cell = summary[name]
        assert "error" not in cell, cell.get("error")
        assert cell["step_ms"] > 0 and cell["step_ms_median"] > 0 and cell["cpu_ms"] > 0
        assert cell["phases_ms"]["forward"] > 0 and cell["phases_ms"]["backward"] > 0
        assert cell["phases_ms"]["input_dist"] > 0 and cell["phases_ms"]["output_dist"] > 0
        if "2x2" in name:
            assert cell["rounds"] > 0 and cell["reduction_ms_per_step"] > 0 and cell["reduction_ms_per_round"] > 0
            assert cell["payload_bytes_per_round"] > 0 and cell["wire_bytes_per_round"] > 0
            assert cell["plain_ms"] > 0 and cell["plain_bytes"] == pytest.approx(cell["payload_bytes_per_round"], abs=1)
            assert cell["cross_node_bytes_per_step"] > 0  # contiguous: the replica groups span the two nodes
    assert summary["twod 1x4"]["rounds"] == 0  # 1D: nothing to reduce
    assert summary["twod 2x2c k2 blocking bf16"]["round_vs_plain"] > 0
    assert "round_vs_plain" not in summary["twod 2x2c k2 overlap bf16"]  # an overlapped round is not timed whole
    bf16, fp32 = (summary[f"twod 2x2c k2 overlap {d}"]["payload_bytes_per_round"] for d in ("bf16", "fp32"))
    assert bf16 == pytest.approx(fp32 / 2, rel=0.02)


def test_the_bound_cell_times_steps_without_any_round(quick_run):
    bound = _summary(quick_run)[BOUND_CELL]
    assert "error" not in bound, bound.get("error")
    assert bound["rounds"] == 0 and bound["reduction_ms_per_step"] < 0.1 and "plain_ms" not in bound
    assert bound["step_ms"] > 0 and bound["phases_ms"]["output_dist"] > 0
    ratios = quick_run["results"]["criteo"]["unshaped"]["ratios"]
    assert ratios["best_2d"] != BOUND_CELL  # a bound is never a candidate, only the limit of one
    assert ratios["vs_1d"]["bound"]["fast"] == BOUND_CELL


def test_every_round_and_the_outputs_are_written(quick_run):
    rounds = quick_run["results"]["criteo"]["unshaped"]["rounds"]
    for name in TWOD_CELLS:
        (row,) = rounds[name]
        assert row["round"] == 0 and len(row["loadavg"]) == 2
    assert [m["round"] for m in quick_run["rounds_meta"]] == [0]
    assert quick_run["rounds_meta"][0]["loadavg_before"] and not quick_run["complete_grid"]
    page = (quick_run["_out"] / "scaling.md").read_text()
    assert "QUICK RUN" in page and "twod 2x2c k2 overlap bf16" in page
    assert (quick_run["_out"] / "scaling.png").stat().st_size > 0


def test_torchrec_cell(quick_run):
    if not (TORCHREC_VENV / "bin" / "python").exists():
        pytest.skip(f"{TORCHREC_VENV} is missing (bash benchmarks/setup_torchrec.sh): the TorchRec cell is not run")
    cell = _summary(quick_run)[TORCHREC_CELL]
    assert "error" not in cell, cell.get("error")
    assert cell["step_ms"] > 0 and cell["phases_ms"]["forward"] > 0 and cell["rounds"] == 0




def test_the_headline_page_reads_the_same_cells(quick_run, tmp_path):
    done = subprocess.run([sys.executable, str(OVERLAP), "--quick", "--report-only", "--rounds", "1", "--rate",
                           "unshaped", "--workloads", "criteo", "--work-dir", str(quick_run["_work"]),
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    page = (tmp_path / "overlap.md").read_text()
    ratio = next(line for line in page.splitlines()
                 if line.startswith("| `twod 2x2c k2 overlap bf16` / `bound 2x2c no reduction`"))
    cells = [c.strip() for c in ratio.split("|")]
    median, rounds = float(cells[2].strip("*x")), [float(r) for r in cells[3].split(",")]
    assert median > 0 and median == rounds[0]  # one round: the median is that round's ratio
    assert cells[4].startswith("0.90x") and ("met" in cells[4] or "missed" in cells[4])
    assert "The round in `twod 2x2c k2 overlap bf16`" in page and "packing the wire buffer" in page
    assert "| `twod 1x4` |" in page and "round 0:" in page
