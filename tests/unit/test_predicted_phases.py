"""``benchmarks/predicted_phases.py`` on a recorded run: each measured phase beside the planner's."""

from __future__ import annotations

import pytest

from tests.helpers.benchmark_scripts import load_benchmark
from tests.unit.test_planner_round_costs import TODAY


def _record(pp, name: str, step_ms: float, rounds: int) -> dict:
    scaling = pp.calibration.scaling
    work = scaling.WORKLOADS["pooled"]
    cell = next(c for c in scaling.grid(False) if c["name"] == name)
    cell = {**cell, "fingerprint": scaling.fingerprint(work, cell)}
    phases = {"forward": 30.0, "backward": 40.0, "optimizer": 10.0, "input_dist": 4.0, "lookup": 2.0,
              "output_dist": 6.0, "output_dist_backward": 7.0, "lookup_backward": 8.0, "dense_allreduce": 20.0,
              "sparse_update": 9.0, "cross_group": 5.0}
    counters = {"rounds": rounds, "part_agree_rows": 0.01 * rounds, "part_pack": 0.02 * rounds,
                "part_apply": 0.03 * rounds, "part_wait": 0.004 * rounds}
    ranks = [{"rank": r, "step_ms": step_ms + 2 * r, "phases_ms": phases, "counters": counters,
              "group_sizes": {f"t_cat_{i}": cell["shard"] for i in range(work.num_tables)}} for r in range(4)]
    return {"workload": "pooled", "rate": "1gbit", "round": 0, "cell": cell, "ranks": ranks}


def test_each_measured_phase_stands_beside_the_planners():
    pp = load_benchmark("predicted_phases")
    records = [_record(pp, "twod 2x2c k8 overlap bf16", 100.0, 2), _record(pp, "twod 1x4", 80.0, 0)]
    phases, per_round = pp.report(records, TODAY).split("Per round")
    rows = {line.split(" | ")[1]: line for line in phases.splitlines() if line.startswith("| pooled")}
    time = pp.predict(records[0], TODAY)
    row = rows["`twod 2x2c k8 overlap bf16`"]
    # the median rank's step; output dist forward and backward; the sparse update less the round in it
    assert row.split(" | ")[2] == f"103 / {time.total * 1e3:.0f}"
    assert f" 13 / {time.output_all_to_all * 1e3:.0f} " in row
    assert f" 14 / {time.lookup * 1e3:.0f} " in row  # 2 + 8 + (9 - 5)
    assert f" 20 / {(time.dense_all_reduce + time.dense_wait) * 1e3:.0f} " in row
    round_rows = [line for line in per_round.splitlines() if line.startswith("| pooled")]
    assert len(round_rows) == 1 and "`twod 2x2c k8 overlap bf16` | 10 | 50 | 4 |" in round_rows[0]
    one_d = pp.predict(records[1], TODAY)
    assert one_d.reduction == 0.0 and time.reduction > 0.0
    assert time.round_traffic * 1e3 == pytest.approx(float(round_rows[0].split(" | ")[5]), abs=0.5)


def test_the_wait_for_ddp_stands_beside_the_planners_on_the_median_and_the_last_rank():
    pp = load_benchmark("predicted_phases")
    records = [_record(pp, "twod 2x2c k8 overlap bf16", 100.0, 2), _record(pp, "twod 1x4", 80.0, 0)]
    assert "last rank" not in pp.report(records, TODAY)  # records made before the marks: no table
    for rank in records[0]["ranks"]:  # rank 3 ends its backward last and waits 6 ms; the others more
        end = 1.0 + 0.01 * rank["rank"]
        rank["dense_marks"] = [[end + step, 1.036 + step] for step in range(4)]
    waits = pp.report(records, TODAY).split("after the backward's own work")[1]
    rows = [line for line in waits.splitlines() if line.startswith("| pooled")]
    time = pp.predict(records[0], TODAY)
    assert rows == [f"| pooled | `twod 2x2c k8 overlap bf16` | 20.0 | 6.0 | "
                    f"{(time.dense_all_reduce + time.dense_wait) * 1e3:.1f} |"]


def test_auto_writes_the_phases_of_its_sitting_beside_its_report(tmp_path):
    import json

    pp, auto = load_benchmark("predicted_phases"), load_benchmark("auto")
    records = [_record(pp, "twod 2x2c k8 overlap bf16", 100.0, 2), _record(pp, "twod 1x4", 80.0, 0)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    auto.write_phases(tmp_path, TODAY, tmp_path / "phases.md")
    assert (tmp_path / "phases.md").read_text() == pp.report(records, TODAY)
