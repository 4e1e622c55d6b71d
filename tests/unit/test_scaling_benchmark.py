"""The scaling benchmark's (benchmarks/scaling.py) aggregation on made-up rank results: the slowest
rank, the reduction's share, and whether a free reduction would meet a missed target (its runs on the
testbed: ``tests/system/test_scaling_benchmark.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


SCALING = ROOT / "benchmarks" / "scaling.py"


def _load_scaling():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_scaling", SCALING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_missed_target_says_whether_a_free_reduction_would_meet_it():
    scaling = _load_scaling()
    steps = {"twod 1x4": 100.0, "twod 2x2c k8 overlap fp32": 80.0, "bound 2x2c no reduction": 60.0,
             "bound 4x1 no reduction": 40.0, "torchrec dmp 1d": 90.0, "torchrec dmpc-default k8": 84.0}
    rows = {name: {0: {"step_ms": ms}} for name, ms in steps.items()}
    summary = {name: {"step_ms": ms, "phases_ms": {"forward": ms / 2, "backward": ms / 2}}
               for name, ms in steps.items()}
    ratios = scaling.compare(rows, summary)
    assert ratios["best_2d"] == "twod 2x2c k8 overlap fp32"
    assert ratios["vs_1d"]["median"] == pytest.approx(1.25)
    assert ratios["vs_1d"]["bound"]["fast"] == "bound 4x1 no reduction"
    assert ratios["vs_1d"]["bound"]["median"] == pytest.approx(2.5)
    assert ratios["2x2_vs_dmpc_k8"]["bound"]["median"] == pytest.approx(1.4)  # only the 2x2 bound
    results = {"summary": summary, "ratios": ratios}
    vs_1d, vs_dmp, _, vs_dmpc, pooled = scaling.verdicts({"criteo": {"1gbit": results},
                                                          "pooled": {"unshaped": results}})
    assert "**missed**" in vs_1d and vs_1d.endswith("with no round at all, `bound 4x1 no reduction` gives 2.50x.")
    assert vs_dmp.endswith("gives 2.25x.")  # 90 / 40 ms: a cheaper reduction could meet it
    assert vs_dmpc.endswith("gives 2.10x, so no reduction can meet the target on this testbed.")  # 84 / 40 ms
    assert pooled.endswith("`bound 2x2c no reduction` gives 1.40x, so no reduction can meet the target on this "
                           "testbed.")


def test_aggregate_takes_the_slowest_rank_and_splits_the_reduction():
    scaling = _load_scaling()

    def rank(step_ms, spent, plain):
        return {"timed_steps": 4, "step_ms": step_ms, "step_ms_each": [step_ms] * 4, "cpu_ms": 5.0, "loss": 0.7,
                "phases_ms": {"forward": 10.0, "optimizer": 8.0, "sparse_update": 6.0, "cross_group": 5.0},
                "counters": {"rounds": 2, "blocking_s": spent, "payload_bytes": 2000, "replica_sync_bytes": 2100,
                             "cross_node_bytes": 400},
                "plain": {"bytes": 1000, "dtype": "float32", "ms": plain}}

    record = {"round": 0, "loadavg_before": "1 1 1", "loadavg_after": "2 2 2",
              "cell": {"name": "twod 2x2c k2 blocking fp32", "overlap": False},
              "ranks": [rank(20.0, 0.010, [2.0, 4.0]), rank(30.0, 0.020, [3.0, 1.0])]}
    row = scaling.aggregate(record)
    assert row["step_ms"] == 30.0 and row["step_ms_median"] == 30.0
    assert row["reduction_ms_per_step"] == pytest.approx(20.0 / 4)
    assert row["reduction_ms_per_round"] == pytest.approx(20.0 / 2)
    assert row["payload_bytes_per_round"] == 1000 and row["cross_node_bytes_per_step"] == 100
    assert row["plain_ms"] == pytest.approx(3.5)  # per repeat the slowest rank (3, 4), then the median
    assert row["round_vs_plain"] == pytest.approx(10.0 / 3.5)
    assert row["phases_ms"]["sparse_update"] == pytest.approx(1.0)  # the reduction is taken out of the sparse step
