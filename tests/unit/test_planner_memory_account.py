"""The cross-group reduction's buffers in the memory account (``planner/memory.py``), term by term, for
the rounds the simulator compares."""

from __future__ import annotations

import pytest

from lightning_twod.core.reduction import CHUNK, DENSE_SHARE, GROWTH
from lightning_twod.planner import TableSpec, Workload, plan_model
from lightning_twod.planner.memory import reduction_buffers
from lightning_twod.planner.reduction import reduction_rounds

# one hot table (sent whole after a few steps), two cold ones (touched rows gathered)
SPECS = [TableSpec("hot", 20_000, 32, pooling_factor=20.0), TableSpec("cold", 4_000_000, 64),
         TableSpec("colder", 2_000_000, 16)]


def _account(interval: int, overlap: bool, sync_bytes: int) -> tuple[list[float], list, list[float]]:
    """The account per shard position, the rounds, and the bytes of the replicated shards (weights and state)."""
    workload = Workload(batch_size=512, sync_interval=interval, sync_overlap=overlap, sync_bytes=sync_bytes)
    plan = plan_model({"m": SPECS}, 8, 2, workload)
    rounds, _ = reduction_rounds(SPECS, plan.modules["m"], 2, 4, workload)
    shards = [0.0, 0.0]
    for sharding in plan.modules["m"].values():
        for shard in sharding.shards:
            shards[shard.owner] += shard.rows * (shard.dim + 1) * 4
    return reduction_buffers(SPECS, plan.modules["m"], 2, 4, workload), rounds, shards


@pytest.mark.parametrize("interval", [4, 16])
def test_overlapped_fp32_rounds_count_the_rows_a_drain_gathers(interval):
    account, rounds, _ = _account(interval, True, 4)
    assert any(r.whole for r in rounds) and any(r.gathered for r in rounds)
    for held, r in zip(account, rounds, strict=True):
        snapshot_and_wire = r.elements * 8 + (CHUNK + max(r.largest_chunk, r.largest_whole_chunk)) * 4
        # a drain's blocking round reduces the steps since the launch: at most the rows a round gathers,
        # and under DENSE_SHARE of a shard a round sends whole (gathered then, in place after a round)
        assert held == pytest.approx(snapshot_and_wire + (r.gathered + DENSE_SHARE * r.whole) * 4)


def test_no_drain_buffer_where_a_drain_finds_nothing_to_reduce_and_on_bf16_the_wire_grows_to_every_row():
    every_step, rounds, _ = _account(1, True, 4)  # every launch leaves no step to drain
    assert every_step == pytest.approx([r.elements * 8 + (CHUNK + max(r.largest_chunk, r.largest_whole_chunk)) * 4
                                        for r in rounds])
    bf16, rounds, shards = _account(4, True, 2)  # the drain's bf16 round reuses the wire and chunk buffers
    # the changes sent, kept (bf16), the wire (bf16), a chunk of scratch and three of rows (the rows, their
    # references, the changes sent), and the fp32 reference copy of every replicated shard; then what the
    # drain adds to the wire: it sends every row the overlapped rounds sent since the last round that waited,
    # up to all of them (in bf16), into a wire buffer grown by GROWTH
    assert bf16 == pytest.approx([r.elements * 4 + (CHUNK + 3 * max(r.largest_chunk, r.largest_whole_chunk)) * 4
                                  + whole + GROWTH * whole / 2 - r.elements * 2
                                  for r, whole in zip(rounds, shards, strict=True)])
    assert all(whole / 2 > r.elements * 2 for r, whole in zip(rounds, shards, strict=True))

