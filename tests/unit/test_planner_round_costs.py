"""What a round costs and what the step waits for, on links measured on the two-node testbed, and
the layouts the model ranks first on the three workloads measured there (no timing here: the
measured numbers are recorded below, each with where it comes from)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_twod.planner import CollectiveCost, DenseModel, LinkModel, TableSpec, Workload, choose_layout
from lightning_twod.planner.reduction import ReductionRound
from lightning_twod.planner.steptime import GroupShape, StepTime, round_seconds

#: ``python -m lightning_twod calibrate`` on the testbed at 1 Gbit/s (4 ranks, 2 per namespace), the
#: fastest of 3 probes of 10 s (2026-12-07 06:21, the day the rounds below were measured)
TODAY = LinkModel(CollectiveCost(0.727531e9, 160.886e-6), CollectiveCost(0.0671254e9, 205.531e-6),
                  CollectiveCost(0.956524e9, 229.742e-6), CollectiveCost(0.068812e9, 168.966e-6),
                  11.8715e9, 13.7778e9, 0.134738e12, 2, overlap_share=0.0205804, name="testbed-1gbit")
#: the same, the median of 3 probes of 10 s (2026-12-01; the file docs/planner.md prints)
DEC_01 = LinkModel(CollectiveCost(1.19569e9, 646.946e-6), CollectiveCost(0.0578069e9, 1281.7e-6),
                   CollectiveCost(1.16779e9, 882.738e-6), CollectiveCost(0.0680497e9, 1111.57e-6),
                   6.46801e9, 12.8687e9, 0.0597022e12, 2, overlap_share=0.112213, name="testbed-1gbit")
#: the fastest of 3 probes of 1 s, what a set-up measures (2026-12-07 06:21): its messages partly pass in
#: the token bucket's burst (1.25 MB at 1 Gbit/s), so it reads twice the link's rate across the namespaces
SET_UP = LinkModel(CollectiveCost(0.921247e9, 122.616e-6), CollectiveCost(0.139021e9, 150.828e-6),
                   CollectiveCost(0.291475e9, 156.539e-6), CollectiveCost(0.136006e9, 166.4e-6),
                   13.0593e9, 14.2422e9, 0.139744e12, 2, overlap_share=1.2009, name="testbed-1gbit, 1 s")
#: a probe whose all-reduce across nodes read 4x the 10 s probe's and hid entirely beside compute (a
#: share of 0.00 was measured there too, benchmarks/results/calibration_history.md)
BURST = replace(DEC_01, all_reduce_inter=CollectiveCost(4 * 0.0680497e9, 1111.57e-6), overlap_share=0.0,
                name="testbed-1gbit, burst")
GIB = 2.0**30


def dlrm_dense(tables: int) -> DenseModel:
    """The benchmarks' DLRM (``benchmarks/workload.py``): bottom 13 -> 256 -> 64, dot interaction,
    top -> 256 -> 128 -> 1; its dense parameters."""
    top_in = 64 + (tables + 1) * tables // 2
    return DenseModel(13 * 256 + 256 + 256 * 64 + 64 + top_in * 256 + 256 + 256 * 128 + 128 + 129)


def workload(batch: int, wire: str) -> Workload:
    return Workload(batch_size=batch, optimizer="rowwise_adagrad", sync_interval=8, sync_overlap=True,
                    sync_bytes={"bf16": 2, "fp32": 4}[wire])


#: ``benchmarks/scaling.py``'s workloads: power-law ids (skew 3); pooled bags of 1 to 19 ids (10 a bag)
POOLED = {"sparse": [TableSpec(f"t_cat_{i}", 100_000, 64, pooling_factor=10.0, id_skew=3.0) for i in range(8)]}
CRITEO = {"sparse": [TableSpec(f"t_cat_{i}", 100_000, 64, id_skew=3.0) for i in range(26)]}
SKEWED = {"sparse": [TableSpec("t_cat_0", 4_000_000, 64, id_skew=3.0)]
          + [TableSpec(f"t_cat_{i}", 100_000, 64, id_skew=3.0) for i in range(1, 27)]}


def test_a_rounds_passes_cost_what_they_were_measured_to_cost():
    # pooled, 2x2 contiguous, interval 8, overlapped bf16 (benchmarks/results/overlap/overlap.md): a rank's
    # round gathers 83 % of its 4 tables' rows, 21.65 M elements of weights and state, and packed and applied
    # them in 209.5 + 208.7 ms (the slowest rank's median round)
    rnd = ReductionRound(gathered=21.65e6, mask_bytes=400_000 / 8, rows=400_000)
    _, passes = round_seconds(TODAY, GroupShape(2, 1), rnd, workload(1024, "bf16"), 2)
    assert passes == pytest.approx(0.418, rel=0.2)
    # Criteo-like, the same layout and round: 47.3 M elements, 446.2 + 472.0 ms
    rnd = ReductionRound(gathered=47.3e6, mask_bytes=1_300_000 / 8, rows=1_300_000)
    _, passes = round_seconds(TODAY, GroupShape(2, 1), rnd, workload(4096, "bf16"), 2)
    assert passes == pytest.approx(0.918, rel=0.2)
    # pooled, groups of 1 (every table on every rank; 2026-12-07, 1 Gbit/s, bf16): 43.3 M elements, packed and
    # applied in 466-715 ms by the four ranks (median 586)
    rnd = ReductionRound(gathered=43.3e6, mask_bytes=800_000 / 8, rows=800_000)
    _, passes = round_seconds(TODAY, GroupShape(4, 2), rnd, workload(1024, "bf16"), 2)
    assert passes == pytest.approx(0.586, rel=0.3)


def _global(specs, wire: str, batch: int, links: LinkModel, tables: int) -> dict[int, StepTime]:
    _, candidates, _ = choose_layout(specs, 4, 2, 64 * GIB, workload(batch, wire), links, dlrm_dense(tables),
                                     placement="contiguous")
    return {c.group_size: c.time for c in candidates}


@pytest.mark.parametrize("links", [TODAY, DEC_01, SET_UP, BURST], ids=["today", "dec-01", "set-up", "burst"])
@pytest.mark.parametrize("wire", ["bf16", "fp32"])
def test_pooled_bags_touch_most_rows_so_1d_beats_replicas(links, wire):
    # measured (issue sitting, interval 8, overlapped): 1D 79-94 ms, 2x2 108-129, S=1 271-282 (bf16), 498 (fp32)
    times = _global(POOLED, wire, 1024, links, 8)
    assert times[4].total < times[2].total < times[1].total
    best, _, text = choose_layout(POOLED, 4, 2, 64 * GIB, workload(1024, wire), links, dlrm_dense(8),
                                  placement="contiguous")
    assert best.group_size == 4
    assert "AR wait" in text  # the explanation prints every phase


@pytest.mark.parametrize("links", [TODAY, DEC_01], ids=["today", "dec-01"])
@pytest.mark.parametrize("wire", ["bf16", "fp32"])
def test_criteo_like_2x2_beats_1d_and_full_replication(links, wire):
    # measured: 2x2 492-574 ms (bf16) and 399 (fp32), 1D 747-765, S=1 875 on the fp32 wire
    times = _global(CRITEO, wire, 4096, links, 26)
    assert times[2].total < times[4].total
    assert times[2].total < times[1].total


@pytest.mark.parametrize("links", [TODAY, DEC_01], ids=["today", "dec-01"])
def test_skewed_model_per_table_beats_1d(links):
    # measured: the large table in a group of 4, the others in groups of 2: 368-424 ms; 1D 766-788
    def predicted(group_size: int, own_sizes=None) -> float:
        best, _, _ = choose_layout(SKEWED, 4, 2, 1.75 * GIB, workload(4096, "bf16"), links, dlrm_dense(27),
                                   group_size=group_size, placement="contiguous", own_sizes=own_sizes)
        return best.time.total

    assert predicted(2, {"t_cat_0": 4}) < 0.8 * predicted(4)


def test_the_dense_all_reduce_waits_behind_the_all_to_all_on_its_link():
    specs = {"sparse": [TableSpec(f"t{i}", 100_000, 64, id_skew=3.0) for i in range(8)]}

    def phases(dense: DenseModel) -> dict[int, StepTime]:
        _, candidates, _ = choose_layout(specs, 4, 2, 64 * GIB, workload(1024, "bf16"), TODAY, dense,
                                         placement="contiguous")
        return {c.group_size: c.time for c in candidates}

    large, small = phases(DenseModel(10e6)), phases(dlrm_dense(8))  # 40 MB of gradients, and 0.3 MB
    # 1D on two nodes: behind the all-to-all's backward, only the lookups' backward is left to hide it
    assert large[4].dense_wait > 0.0
    assert large[4].dense_wait > small[4].dense_wait
    # groups of 2 inside a node: the all-to-all stays off the link DDP's all-reduce crosses
    assert large[2].dense_wait == 0.0 and large[1].dense_wait == 0.0
    assert large[4].total == pytest.approx(sum(getattr(large[4], p) for p in StepTime.PHASES))
