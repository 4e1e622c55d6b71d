"""The 1D comparison of the benchmarks with TorchRec, no script run: TorchRec's worker reads its lookup
where the bundled ``DLRM`` reads ours (after the bottom MLP), the bare model has nothing before the
lookup, and ``overlap.py`` reports a sitting of only some of its cells."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from tests.helpers.benchmark_scripts import load_benchmark


class _Lazy:
    """A lookup's result that records when it is read (as TorchRec's awaitable, waited for there)."""

    def __init__(self, events: list[str], batch: int, width: int) -> None:
        self.events, self.batch, self.width = events, batch, width

    def values(self) -> torch.Tensor:
        self.events.append("lookup read")
        return torch.zeros(self.batch, self.width)


class _Lookup(nn.Module):
    def __init__(self, events: list[str], width: int) -> None:
        super().__init__()
        self.events, self.width = events, width

    def forward(self, kjt):
        self.events.append("lookup called")
        return _Lazy(self.events, kjt, self.width)


@pytest.mark.parametrize("model", ["dlrm", "bare"])
def test_torchrec_worker_reads_its_lookup_where_ours_is_read(model):
    pytest.importorskip("torchrec")
    worker = load_benchmark("torchrec_worker")
    work = replace(worker.W.Workload(num_tables=3, rows=10, dim=4, batch=5, bottom=[8], top=[8]), model=model)
    built = worker.build_model(work)
    events: list[str] = []
    built.sparse = _Lookup(events, work.num_tables * work.dim)
    if model == "dlrm":
        built.bottom.register_forward_hook(lambda *_: events.append("bottom MLP"))
        expected = ["lookup called", "bottom MLP", "lookup read"]  # the rows travel while the bottom MLP runs
    else:
        assert not hasattr(built, "bottom") and isinstance(built.head, nn.Linear)
        assert built.head.in_features == work.num_tables * work.dim
        expected = ["lookup called", "lookup read"]  # nothing before the lookup, nothing to overlap
    logits = built(torch.randn(work.batch, worker.W.NUM_DENSE), work.batch)
    assert events == expected and logits.shape == (work.batch,)


def test_the_bare_workloads_are_the_tables_of_the_others_with_the_bare_model():
    scaling = load_benchmark("scaling")
    for name in ("criteo", "pooled", "skewed"):
        bare = scaling.WORKLOADS[f"{name}-bare"]
        assert bare.model == "bare" and replace(bare, model="dlrm") == scaling.WORKLOADS[name]
        assert scaling.QUICK[f"{name}-bare"].model == "bare"
    assert scaling.DEFAULT_WORKLOADS == ("criteo", "pooled")  # the headline's sitting is unchanged
    # the bare model's dense part, as the planner is told it: one linear layer over the pooled rows
    calibration = load_benchmark("calibration")
    dense = calibration.dense_of(scaling.WORKLOADS["skewed-bare"])
    assert dense.params == 27 * 64 + 1 and dense.flops == 6 * 27 * 64


def test_overlap_report_of_the_1d_cells_only(tmp_path):
    overlap = load_benchmark("overlap")
    cells = {key: name for key, name in overlap.CELLS.items() if key in ("1d", "torchrec")}
    rounds = {"twod 1x4": [{"round": 0, "step_ms": 100.0}, {"round": 1, "step_ms": 90.0}],
              "torchrec dmp 1d": [{"round": 0, "step_ms": 110.0}, {"round": 1, "step_ms": 81.0}]}
    summary = {name: {"step_ms": runs[0]["step_ms"], "step_ms_rounds": [r["step_ms"] for r in runs],
                      "phases_ms": {"forward": 10.0}} for name, runs in rounds.items()}
    data = {"results": {"pooled-bare": {"1gbit": {"summary": summary, "rounds": rounds}}},
            "rounds_meta": [{"round": 0, "loadavg_before": "1", "loadavg_after": "2"}]}
    text = overlap.write_report(data, tmp_path / "bare.md", cells)
    assert "| `twod 1x4` / `torchrec dmp 1d` | **1.00x** | 1.10, 0.90 | 1.00x met |" in text
    assert "bound" not in text and "k8" not in text  # only the ratios between the cells that ran
    assert (tmp_path / "bare.md").read_text() == text
