"""The step-time model on numbers alone: collectives on shared links, the reduction's round (bytes
as the engine counts them, bf16, interval, overlap), the dense part, a measured local step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_twod.planner import (
    PRESETS,
    CollectiveCost,
    DenseModel,
    LinkModel,
    TableSpec,
    Workload,
    plan_model,
    predict_traffic,
    step_time,
)
from lightning_twod.planner.reduction import reduction_rounds
from lightning_twod.planner.steptime import GroupShape, all_reduce_time, all_to_all_time, group_shapes, overlapped

LINKS = LinkModel(CollectiveCost(1e9, 1e-3), CollectiveCost(0.05e9, 2e-3), CollectiveCost(1.2e9, 0.5e-3),
                  CollectiveCost(0.06e9, 1e-3), 10e9, 40e9, 50e9, 2, name="testbed-like")
SPECS = {"sparse": [TableSpec(f"t{i}", 100_000, 32, pooling_factor=2, id_skew=3.0) for i in range(6)]}


def _plan(size: int, placement: str = "contiguous", world: int = 4):
    return plan_model(SPECS, world, size, Workload(batch_size=512), placement=placement, ranks_per_node=2,
                      links=LINKS)


def test_group_shapes_follow_the_placement():
    # 4 ranks, 2 per node: contiguous 2 x 2 keeps shard groups on a node, strided keeps replica groups there
    assert group_shapes(4, 2, "contiguous", 2) == (GroupShape(2, 2), GroupShape(2, 1), GroupShape(4, 2))
    assert group_shapes(4, 2, "strided", 2) == (GroupShape(2, 1), GroupShape(2, 2), GroupShape(4, 2))
    assert not group_shapes(4, 4, "contiguous", 4)[0].spans_nodes


def test_collectives_share_the_node_link():
    local, remote = GroupShape(2, 2), GroupShape(2, 1)
    assert all_to_all_time(LINKS, local, 1e6, 1e6, 2) == pytest.approx(1e-3 + 1e6 / 1e9)
    # one member per node, both ranks of a node crossing at once: each gets its measured share
    assert all_to_all_time(LINKS, remote, 1e6, 1e6, 2) == pytest.approx(2e-3 + 1e6 / 0.05e9)
    # a 4-rank group over 2 nodes: 2 of 3 peers remote, the node's two ranks share the link
    assert all_to_all_time(LINKS, GroupShape(4, 2), 3e6, 3e6, 2) == pytest.approx(4e-3 + 2 * 2e6 / 0.1e9)
    # a ring crosses each node boundary once per group: groups of 2 across nodes, two of them per node
    assert all_reduce_time(LINKS, remote, 1e6, 2) == pytest.approx(2e-3 + 2 * 1e6 / 0.12e9)
    # one ring of 4 over 2 nodes: one edge out of each node carries 1.5 buffers
    assert all_reduce_time(LINKS, GroupShape(4, 2), 1e6, 2) == pytest.approx(4e-3 + 1.5e6 / 0.12e9)
    assert all_reduce_time(LINKS, GroupShape(1, 1), 1e9, 2) == 0.0


def test_the_rounds_bytes_are_the_engines():
    plan = _plan(2)
    workload = Workload(batch_size=512, sync_interval=4)
    rounds, _ = reduction_rounds(SPECS["sparse"], plan.modules["sparse"], 2, 2, workload)
    traffic = predict_traffic(SPECS["sparse"], plan.modules["sparse"], 2, 2, workload, steps=4)
    for rnd, counted in zip(rounds, traffic):
        # a ring over 2 copies sends the whole buffer: mask + payload, as ByteCounter counts them
        assert rnd.mask_bytes + 4 * rnd.elements == pytest.approx(counted["replica_sync"])


def test_bf16_interval_and_overlap():
    plan = _plan(2)
    dense = DenseModel(1e5)

    def timed(**changes):
        workload = replace(Workload(batch_size=4096), **changes)
        return step_time(SPECS, plan.modules, 4, 2, "contiguous", 2, workload, LINKS, dense)

    fp32, bf16 = timed(), timed(sync_bytes=2)
    mask = all_reduce_time(LINKS, GroupShape(2, 1), 100_000 * 3 / 8, 2)
    assert bf16.round_transfer - mask == pytest.approx((fp32.round_transfer - mask) / 2, rel=0.02)
    assert bf16.round_traffic > fp32.round_traffic  # the conversions cost memory traffic
    # a longer interval: more rows per round, fewer rounds
    every, eighth = timed(), timed(sync_interval=8)
    assert eighth.round_transfer > every.round_transfer and eighth.reduction < every.reduction
    # overlapped: the round's traffic, plus what the transfer cannot hide under `interval` steps
    blocking, overlapped = timed(sync_interval=2), timed(sync_interval=2, sync_overlap=True)
    assert blocking.reduction == pytest.approx((blocking.round_transfer + blocking.round_traffic) / 2)
    # the rest of the step, less DDP's all-reduce, which crosses the same link
    room = overlapped.total - overlapped.reduction - all_reduce_time(LINKS, GroupShape(4, 2), 1e5 * 4, 2)
    hidden = overlapped.round_traffic + max(0.0, overlapped.round_transfer - 2 * room)
    assert overlapped.reduction == pytest.approx(hidden / 2)


def test_an_overlapped_collective_costs_the_share_compute_still_pays():
    assert overlapped(10.0, 30.0, 0.0) == 0.0 and overlapped(10.0, 4.0, 0.0) == 6.0
    assert overlapped(10.0, 30.0, 0.25) == pytest.approx(2.5)  # the share, the rest hidden
    assert overlapped(10.0, 30.0, 1.0) == 10.0  # no faster than one after the other
    plan = _plan(2)
    workload = Workload(batch_size=4096, sync_interval=2, sync_overlap=True)

    def timed(share):
        return step_time(SPECS, plan.modules, 4, 2, "contiguous", 2, workload, replace(LINKS, overlap_share=share),
                         DenseModel(1e5))

    free, paid = timed(0.0), timed(1.0)
    assert free.reduction < paid.reduction
    assert paid.reduction == pytest.approx((paid.round_traffic + paid.round_transfer) / 2)
    # DDP's all-reduce under backward pays the share too (from FLOPs: no measured step holds it)
    ddp = all_reduce_time(LINKS, GroupShape(4, 2), 1e5 * 4, 2)
    assert free.dense_all_reduce == 0.0 and paid.dense_all_reduce == pytest.approx(ddp)


def test_dense_part_and_a_measured_local_step():
    plan = _plan(4)
    workload = Workload(batch_size=1024)
    flops = step_time(SPECS, plan.modules, 4, 4, "contiguous", 2, workload, LINKS, DenseModel(1e6))
    assert flops.dense_compute == pytest.approx(6e6 * 1024 / 50e9)
    assert flops.lookup > 0 and flops.reduction == 0  # 1D: nothing to reduce
    local = step_time(SPECS, plan.modules, 4, 4, "contiguous", 2, workload, LINKS, DenseModel(1e6, None, 0.3))
    assert local.dense_compute == 0.3 and local.lookup == 0.0
    assert local.output_all_to_all == flops.output_all_to_all
    # the dense all-reduce hides under backward when there is enough of it
    assert local.dense_all_reduce == 0.0


def test_a_slower_network_only_slows_what_crosses_it():
    slow = replace(LINKS, all_to_all_inter=CollectiveCost(0.005e9, 2e-3), all_reduce_inter=CollectiveCost(0.006e9, 1e-3))
    workload = Workload(batch_size=1024)
    contiguous = _plan(2)
    fast_c = step_time(SPECS, contiguous.modules, 4, 2, "contiguous", 2, workload, LINKS)
    slow_c = step_time(SPECS, contiguous.modules, 4, 2, "contiguous", 2, workload, slow)
    assert slow_c.output_all_to_all == fast_c.output_all_to_all  # shard groups inside a node
    assert slow_c.reduction > 5 * fast_c.reduction  # replica groups across
    strided = _plan(2, "strided")
    fast_s = step_time(SPECS, strided.modules, 4, 2, "strided", 2, workload, LINKS)
    slow_s = step_time(SPECS, strided.modules, 4, 2, "strided", 2, workload, slow)
    assert slow_s.reduction == fast_s.reduction and slow_s.output_all_to_all > 5 * fast_s.output_all_to_all


def test_presets_plan_and_time_a_large_world():
    specs = {"sparse": [TableSpec(f"t{i}", 10_000_000, 128, pooling_factor=10, id_skew=8, hashed=True)
                        for i in range(8)]}
    plan = plan_model(specs, 256, 32, Workload(batch_size=1024), ranks_per_node=8, links="h100")
    time = step_time(specs, plan.modules, 256, 32, "contiguous", 8, Workload(batch_size=1024), PRESETS["h100"])
    assert 0 < time.total < 1.0 and time.reduction > 0 and time.output_all_to_all > 0
