"""``benchmarks/auto.py`` without a testbed: its cells exist in ``scaling.py``'s grid, only the skewed
model has a memory budget, and its report judges auto against the best cell of another layout in the same
round."""

from __future__ import annotations

import pytest

from tests.helpers.benchmark_scripts import load_benchmark


@pytest.mark.parametrize("quick", [False, True])
def test_the_cells_are_in_the_grid_and_the_global_layouts_only_where_they_fit(quick):
    auto = load_benchmark("auto")
    grid = {cell["name"] for cell in load_benchmark("scaling").grid(quick)}
    for workload in auto.WORKLOADS + auto.EXTRA_WORKLOADS:
        cells = auto.cells_of(workload, quick)
        assert set(cells.values()) <= grid, workload
        assert {"1d", "auto", "calibrated"} <= set(cells)
        skewed = workload.startswith("skewed")
        assert ("2x2" in cells) == ("4x1" in cells) == (not skewed) == ("pinned" not in cells)


def test_only_the_skewed_workload_plans_with_a_memory_budget():
    scaling = load_benchmark("scaling")
    assert scaling.WORKLOADS["skewed"].memory_gb == scaling.PER_TABLE_BUDGET_GB == 1.75
    assert scaling.WORKLOADS["criteo"].memory_gb is None and scaling.WORKLOADS["pooled"].memory_gb is None
    assert all("memory_gb" not in cell for cell in scaling.grid(False))  # the workload's budget, every cell


def test_the_report_judges_auto_against_the_best_cell_of_another_layout_in_each_round(tmp_path):
    auto = load_benchmark("auto")
    cells = auto.cells_of("pooled", False)
    steps = {"1d": [80.0, 100.0, 120.0], "2x2": [110.0, 90.0, 105.0], "4x1": [300.0, 280.0, 290.0],
             "calibrated": [85.0, 88.0, 85.0], "auto": [270.0, 92.0, 100.0]}
    sizes = {"1d": [4, 4, 4], "2x2": [2, 2, 2], "4x1": [1, 1, 1], "calibrated": [4, 4, 4], "auto": [1, 4, 4]}
    rounds = {cells[key]: [{"round": r, "step_ms": ms, "group_sizes": {"t_cat_0": sizes[key][r]}}
                           for r, ms in enumerate(each)] for key, each in steps.items()}
    summary = {name: {"step_ms": runs[0]["step_ms"], "step_ms_rounds": [r["step_ms"] for r in runs],
                      "phases_ms": {}} for name, runs in rounds.items()}
    data = {"results": {"pooled": {"1gbit": {"summary": summary, "rounds": rounds}}},
            "rounds_meta": [{"round": 0, "loadavg_before": "1", "loadavg_after": "2"}]}
    text = auto.write_report(data, tmp_path / "auto.md", quick=False)
    auto_cell, one_d, two = cells["auto"], cells["1d"], cells["2x2"]
    # round 0: auto replicated the table, the layout of the 4x1 cell, and 1D was faster: missed
    assert f"| `{auto_cell}` | 0 | 270 | `{one_d}` (80) | 0.30 | 300 | `{one_d}` (80) | 0.30 | 0.90 **missed** |" in text
    assert f"| `{auto_cell}` | 1 | 92 | `{cells['calibrated']}` (88) | 0.96 | 100, 88 | `{two}` (90) | 0.98 | 0.90 met |" in text
    # round 2: another set-up of auto's layout ran 15 % faster; the best other layout is slower: met
    assert f"| `{auto_cell}` | 2 | 100 | `{cells['calibrated']}` (85) | 0.85 | 120, 85 | `{two}` (105) | 1.05 | 0.90 met |" in text
    assert f"| `{cells['calibrated']}` | 1 | 88 | `{two}` (90) | 1.02 | 100 | `{two}` (90) | 1.02 | 0.90 met |" in text
    assert f"* `{auto_cell}`: round 0: groups of 1: t_cat_0; round 1: groups of 4: t_cat_0; round 2: groups of 4: t_cat_0" in text
    assert (tmp_path / "auto.md").read_text() == text


def test_round_order_changes_what_each_cell_follows_from_round_to_round():
    order = load_benchmark("scaling").round_order
    for n in range(1, 8):
        items = list(range(n))
        rounds = [order(items, r) for r in range(3)]
        assert all(sorted(o) == items for o in rounds)  # every cell once a round
        if n >= 3:  # a rotation of the round before would keep every cell behind the same one
            pairs = [{(o[i - 1], o[i]) for i in range(1, n)} for o in rounds]
            assert all(not a <= b | {(o[-1], o[0])} for a, b, o in zip(pairs[1:], pairs, rounds))
    rounds = [order(list("abcde"), r) for r in range(3)]  # auto.py's five cells a workload
    for cell in "abcde":  # each follows another cell in every round it does not start
        behind = [o[o.index(cell) - 1] for o in rounds if o.index(cell)]
        assert len(set(behind)) == len(behind)
