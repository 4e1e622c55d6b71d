"""A collection whose tables have their own shard group sizes, against the unsharded module (8 gloo ranks).

Oracle as in ``test_sharded.py``: each rank's forward equals the unsharded forward of its slice of
the global batch, and every row's gradient, summed over the copies of its shard (the replica group
of the table's own group size, or the world for a data-parallel table), equals the unsharded
gradient of the global loss. Here the five tables sit in groups of 2, 8 (1D), 4 and 1 and on every
rank (data-parallel), so the twin runs four parts, each with its own all-to-alls.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_twod.core.shards import ShardingType, TableSharding, place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import GroupLayout, ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed
from tests.helpers.sparse_cases import POOLED_TABLES, make_module, random_batch

WORLD = 8
DEFAULT = 2  # the mesh's group size; the tables below that differ carry their own
SIZES = {"t_tw": 2, "t_rw": 8, "t_cw": 4, "t_dp": DEFAULT, "t_tw2": 1}
ATOL = 1e-5


def per_table_plan() -> dict[str, TableSharding]:
    plan = {}
    for name, rows, dim, _, _, kind in POOLED_TABLES:
        size = SIZES[name]
        placed = place_tables([(name, rows, dim)], size, {name: kind})[name]
        plan[name] = TableSharding(name, placed.sharding_type, placed.shards, None if size == DEFAULT else size)
    return plan


def _worker(rank: int, world: int, batch_sizes: list[int]) -> list:
    meshes = {size: MeshGroups.create(SparseParallelDims(world, size)) for size in sorted(set(SIZES.values()))}

    sgd = SparseOptimizerConfig("sgd", lr=0.1)
    spec = ShardingSpec(meshes[DEFAULT], backend="torch",
                        other_sizes={size: GroupLayout(mesh, sgd) for size, mesh in meshes.items() if size != DEFAULT})

    checked = []
    for pooled in (True, False):
        reference = make_module(pooled, seed=3)
        batch = random_batch(sum(batch_sizes), seed=7)
        parts = batch.split_batch(batch_sizes)
        sharded = shard_collection(reference, spec, plan=per_table_plan())
        sharded.broadcast_copies()
        assert sorted(part.groups.dims.shard_group_size for part in sharded.parts()) == [1, 2, 4, 8]

        out = sharded(parts[rank])
        expected = reference(parts[rank])
        if pooled:
            assert out.keys() == expected.keys()
            torch.testing.assert_close(out.values(), expected.values(), atol=ATOL, rtol=0)
            loss_weights = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(rank))
            (out.values() * loss_weights).sum().backward()
            (expected.values() * loss_weights).sum().backward()
        else:
            assert list(out) == list(expected)
            for feature in expected:
                torch.testing.assert_close(out[feature].values, expected[feature].values, atol=ATOL, rtol=0)
            gen = torch.Generator().manual_seed(rank)
            weights = {f: torch.randn(expected[f].values.shape, generator=gen) for f in expected}
            sum((out[f].values * w).sum() for f, w in weights.items()).backward()
            sum((expected[f].values * w).sum() for f, w in weights.items()).backward()

        # the unsharded gradient of the global loss: the sum of every rank's reference gradient
        for table in reference.tables:
            grad = getattr(reference, sharded.prefix)[table.name].weight.grad
            dist.all_reduce(grad)
        for part in sharded.parts():
            for kernel, shards in part.kernel_shards():
                for shard, param in zip(shards, kernel.shard_weights, strict=True):
                    grad = param.grad.to_dense() if param.grad is not None else torch.zeros_like(param)
                    data_parallel = part.plan[shard.table].sharding_type == ShardingType.DATA_PARALLEL
                    dist.all_reduce(grad, group=part.groups.world if data_parallel else part.groups.replica)
                    full = getattr(reference, sharded.prefix)[shard.table].weight.grad
                    expected_grad = full[shard.row_start:shard.row_end, shard.col_start:shard.col_end]
                    torch.testing.assert_close(grad, expected_grad, atol=ATOL, rtol=0,
                                               msg=lambda m, s=shard: f"{s}: {m}")
                    checked.append((pooled, shard.table, part.groups.dims.shard_group_size))
        # the unsharded state dict, assembled from every part (a collective)
        state = sharded.state_dict()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=0, rtol=0)
    return checked


def test_tables_in_groups_of_their_own_size_match_the_unsharded_module():
    checked = run_distributed(_worker, WORLD, [3, 1, 4, 2, 0, 5, 2, 1])
    seen = {(pooled, table, size) for per_rank in checked for pooled, table, size in per_rank}
    for pooled in (True, False):
        for name, size in SIZES.items():
            assert (pooled, name, size) in seen, f"{name} (groups of {size}, pooled={pooled}) not checked"


@pytest.mark.parametrize("bad, match", [
    ({"t_tw": 3}, "does not divide|must divide"),
])
def test_a_group_size_that_does_not_divide_the_world_is_refused(bad, match):
    from lightning_twod.planner.plan import ShardingPlan

    plan = per_table_plan()
    for name, size in bad.items():
        plan[name] = TableSharding(name, plan[name].sharding_type, plan[name].shards, size)
    with pytest.raises(ValueError, match=f"table 't_tw'.*({match}).*choose one of 1, 2, 4, 8"):
        ShardingPlan(DEFAULT, WORLD, {"sparse": plan})
