"""The benchmark scripts' arithmetic on made-up results, no script run: the throughput breakdown and
aggregate, the calibration's judgement, the repeatability report and the quality report's pairs
(running the scripts: ``tests/system/test_benchmarks.py``)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmark_scripts import load_benchmark


def test_throughput_breakdown_and_aggregate_arithmetic():
    throughput = load_benchmark("throughput")
    work = throughput.W.Workload(world=2, batch=10)
    reports = [
        {"system": "twod_2x2", "step_ms": 100.0, "cpu_ms": 50.0, "loss": 0.5, "kernels": ["FbgemmKernel"],
         "phases_ms": {"forward": 30.0, "input_dist": 5.0, "lookup": 2.0, "backward": 40.0,
                       "dense_allreduce": 10.0, "optimizer": 20.0, "sparse_update": 15.0, "cross_group": 12.0}},
        {"system": "twod_2x2", "step_ms": 120.0, "cpu_ms": 70.0, "loss": 0.5, "kernels": ["FbgemmKernel"],
         "phases_ms": {"forward": 30.0, "input_dist": 7.0, "lookup": 2.0, "backward": 40.0,
                       "dense_allreduce": 10.0, "optimizer": 20.0, "sparse_update": 15.0, "cross_group": 8.0}},
    ]
    row = throughput.aggregate(reports, work)
    assert row["step_ms"] == 120.0  # the slowest rank sets the pace
    assert row["samples_per_s"] == pytest.approx(2 * 10 / 0.12)
    assert row["phases_ms"]["input_dist"] == 6.0 and row["cpu_ms"] == 60.0
    assert row["phases_ms"]["sparse_update"] == 5.0  # the reduction is taken out of the sparse step
    parts = throughput.breakdown(row)
    assert parts["forward_rest"] == 30.0 - 6.0 - 2.0
    assert parts["backward_rest"] == 30.0 and parts["optimizer_rest"] == 5.0
    assert parts["other"] == 120.0 - 30.0 - 40.0 - 20.0
    assert sum(parts.values()) == pytest.approx(row["step_ms"])  # the stacked bar is the whole step


def test_breakdown_charges_the_dense_all_reduce_with_what_the_step_waited_for_it():
    throughput = load_benchmark("throughput")
    # the span from the first bucket to the last (60) encloses the lookups' backward (25); the step
    # waited 8 for it after the backward's own work
    row = {"step_ms": 100.0, "phases_ms": {"forward": 30.0, "backward": 60.0, "optimizer": 5.0,
                                           "lookup_backward": 25.0, "dense_allreduce": 60.0, "dense_wait": 8.0}}
    parts = throughput.breakdown(row)
    assert parts["dense_allreduce"] == 8.0 and parts["backward_rest"] == 60.0 - 25.0 - 8.0
    assert sum(parts.values()) == pytest.approx(row["step_ms"])
    del row["phases_ms"]["dense_wait"]  # a record made before the wait was timed: the span
    assert throughput.breakdown(row)["dense_allreduce"] == 60.0


def test_the_wait_of_the_rank_that_ends_its_backward_last():
    W = load_benchmark("throughput").W
    # per step (end of the backward's own work, last bucket reduced); rank 1 ends last in step 0,
    # rank 0 in step 1 (its bucket was reduced before: no wait)
    marks = [[[9.0, 10.0], [1.0, 1.012], [20.0, 20.0]], [[1.0, 1.003], [1.01, 1.012], [19.0, 20.0]]]
    assert W.last_rank_wait([m[1:] for m in marks]) == pytest.approx(1e3 * (0.002 + 0.0) / 2)
    # only the steps every rank has: the last ones (the timed window)
    assert W.last_rank_wait([marks[0], marks[1][1:]]) == pytest.approx(1e3 * (0.002 + 0.0) / 2)
    assert W.last_rank_wait([[], []]) is None and W.last_rank_wait([]) is None


def test_calibration_judges_a_choice_against_cells_of_the_same_pipelining(monkeypatch):
    calibration = load_benchmark("calibration")
    monkeypatch.setattr(calibration, "auto_choice", lambda settings, *inputs: "1x4")

    def row(layout: str, interval: int, ms: float, pipeline: bool = False) -> dict:
        cell = dict(interval=interval, overlap=False, dtype="fp32", pipeline=pipeline)
        return dict(layout=layout, settings=calibration._settings(cell), measured=ms, stale=False)

    rows = [row("1x4", 1, 66.0), row("1x4", 1, 87.0, pipeline=True), row("2x2c", 8, 100.0), row("2x2c", 1, 140.0),
            row("2x2c", 1, 70.0, pipeline=True)]
    choices = {calibration._fmt_settings(c["settings"]): c for c in calibration._choices(rows, None, None, None)}
    assert set(choices) == {"k1 blocking fp32", "k8 blocking fp32", "k1 blocking fp32 pipelined"}
    # the 1D pick is judged on the 1D cell of the same pipelining, never on its pipelined twin
    for name in ("k1 blocking fp32", "k8 blocking fp32"):
        assert choices[name]["picked_ms"] == 66.0 and choices[name]["within"]
    piped = choices["k1 blocking fp32 pipelined"]
    assert (piped["fastest"], piped["picked_ms"], piped["within"]) == ("2x2c", 87.0, False)


def test_repeatability_takes_round_zero_as_the_prediction_of_round_one(tmp_path):
    repeatability = load_benchmark("repeatability")
    summary = {"twod 1x4": [100.0, 100.0], "twod 2x2c k8 overlap fp32": [90.0, 130.0],
               "twod 4x1 k8 overlap fp32": [95.0, 96.0], "torchrec dmp 1d": [200.0, 210.0],
               "twod 2x2s k8 overlap fp32": [80.0]}  # one round: no repeat to compare
    results = {"criteo": {"1gbit": {"summary": {cell: {"step_ms_rounds": r} for cell, r in summary.items()}}}}
    cells = repeatability.cells_with_rounds(results)[("criteo", "1gbit")]
    assert "twod 2x2s k8 overlap fp32" not in cells and len(cells) == 4
    errors = repeatability.repeat_errors(cells)
    assert errors["twod 2x2c k8 overlap fp32"] == pytest.approx(90 / 130 - 1)
    # round 0 picks 2x2c (90 ms), which round 1 measures at 130 against 4x1's 96: outside 10 %
    (choice,) = repeatability.repeat_choices(cells)
    assert (choice["picked"], choice["fastest"], choice["within"]) == ("twod 2x2c k8 overlap fp32",
                                                                       "twod 4x1 k8 overlap fp32", False)
    page = tmp_path / "page.json"
    page.write_text(json.dumps({"results": results}))
    out = tmp_path / "repeatability.md"
    repeatability.main([str(page), "--out", str(out)])
    assert "1 of 4 cells outside 25% of their own repeat" in out.read_text()
    assert "outside 10% in 1 of 1 settings" in out.read_text()


def test_quality_pairs_each_wire_with_its_fp32_twin_seed_by_seed():
    report = load_benchmark("quality_report")
    from benchmarks.quality import CONFIGS

    twins = report.fp32_twins(CONFIGS)
    assert twins["2d_momentum_bf16"] == "2d_momentum"
    assert twins["2d_momentum_sync8_overlap_bf16"] == "2d_momentum_sync8"
    assert "2d_momentum" not in twins and "1d" not in twins
    runs = [{"seed": s, "auc": a} for s, a in ((0, 0.78), (1, 0.77), (2, 0.79))]
    twin_runs = [{"seed": s, "auc": a} for s, a in ((0, 0.77), (1, 0.77), (3, 0.70))]  # seed 3: no pair
    mean, error, count = report.paired_difference(runs, twin_runs, "auc")
    assert count == 2 and mean == pytest.approx(0.005) and error == pytest.approx(0.005)
    assert report.paired_difference(runs, [{"seed": 5, "auc": 0.7}], "auc") is None
