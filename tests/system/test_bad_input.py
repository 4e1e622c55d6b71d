"""Bad sparse input on sharded collections (2x2 and 1x4 gloo meshes): only rank 1 gets the bad batch,
yet every rank raises the same ValueError, naming the feature (and table) and the offending value,
before any id is sent (the byte counter stays at zero: the verdicts ride in the header exchange,
which counts only once ids follow), no shard weight or gradient changes, and all ranks then run a
good training step together (nobody is stuck in a collective). On 1x4 the shard group is the world
and the header carries the verdict alone; on 2x2 a world flag tells the other group.
"""

from __future__ import annotations

import pytest
import torch

from lightning_twod.core.shards import place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.bad_batches import BATCH_SEED, BATCH_SIZES, KINDS, bad_batch
from tests.helpers.distributed import run_distributed
from tests.helpers.sparse_cases import POOLED_TABLES, constraints, make_module, random_batch


def _plan(group_size: int):
    return place_tables([(n, r, d) for n, r, d, *_ in POOLED_TABLES], group_size, constraints())


def _loss(out, pooled: bool):
    if pooled:
        return out.values().pow(2).sum()
    return sum(j.values.pow(2).sum() for j in out.values())


def _bad_input_worker(rank, world, group_size):
    groups = MeshGroups.create(SparseParallelDims(world, group_size))
    good = random_batch(sum(BATCH_SIZES), seed=BATCH_SEED).split_batch(BATCH_SIZES)[rank]
    report = {}
    for pooled in (True, False):
        reference = make_module(pooled, seed=3)
        counter = ByteCounter(rank, world)
        sharded = shard_collection(reference, ShardingSpec(groups, backend="torch", counter=counter,
                                                           optimizer=SparseOptimizerConfig("sgd", lr=0.5)),
                                   plan=_plan(group_size))
        before = [(str(shard), w.clone()) for shard, w in sharded.local_shards()]
        messages = {}
        for kind in KINDS:
            batch, expected = bad_batch(good, kind) if rank == 1 else (good, [])
            try:
                sharded(batch)
            except ValueError as err:
                messages[kind] = str(err)
            else:
                raise AssertionError(f"rank {rank}: no ValueError for {kind} (pooled={pooled})")
            for needle in expected:  # the bad rank's own message, before the gather
                assert needle in messages[kind], f"{kind}: {needle!r} not in {messages[kind]!r}"
        # nothing was sent, looked up or updated while the batches were bad
        assert counter.total() == 0, f"rank {rank} sent {counter.by_name()} before the check failed"
        for (name, old), (_, new) in zip(before, sharded.local_shards(), strict=True):
            assert torch.equal(old, new), f"rank {rank}: shard {name} changed during the failing calls"
        for kernel in sharded.kernels():
            assert all(p.grad is None for p in kernel.shard_weights)

        # every rank can still run one good step together
        out = sharded(good)
        expected_out = reference(good)
        if pooled:
            torch.testing.assert_close(out.values(), expected_out.values(), atol=1e-5, rtol=0)
        else:
            for feature in expected_out:
                torch.testing.assert_close(out[feature].values, expected_out[feature].values, atol=1e-5, rtol=0)
        _loss(out, pooled).backward()
        for kernel in sharded.kernels():
            kernel.step()
        changed = [name for (name, old), (_, new) in zip(before, sharded.local_shards(), strict=True)
                   if not torch.equal(old, new)]
        assert counter.total() > 0
        report[pooled] = (messages, changed)
    return report


@pytest.mark.parametrize("group_size", [2, 4], ids=["2x2", "1x4"])
def test_bad_input_on_one_rank_raises_on_every_rank(group_size):
    reports = run_distributed(_bad_input_worker, 4, group_size, timeout=120)
    for pooled in (True, False):
        for kind in KINDS:
            per_rank = [r[pooled][0][kind] for r in reports]
            assert len(set(per_rank)) == 1, f"{kind}: ranks raised different messages {per_rank}"
            message = per_rank[0]
            assert "rank 1" in message and "rank 0" not in message, message
        # the good step after the failures updated rows on every rank
        assert all(r[pooled][1] for r in reports), [r[pooled][1] for r in reports]
