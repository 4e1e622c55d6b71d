"""Sharded collections against the unsharded module, on real gloo process groups.

Oracle: for each rank, the sharded forward equals the unsharded forward of that rank's slice of
the global batch; and for every table row, the gradient summed over the ranks that hold a copy
of it (the replica group, or the whole world for data-parallel tables) equals the unsharded
gradient of the global loss ``sum_r <out_r, G_r>``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_twod.core.shards import ShardingType, place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed
from tests.helpers.sparse_cases import POOLED_TABLES, constraints, make_module, random_batch

ATOL = 1e-5


def _plan(group_size: int):
    return place_tables([(n, r, d) for n, r, d, *_ in POOLED_TABLES], group_size, constraints())


def _global_output_weights(reference_out, pooled: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if pooled:
        return torch.randn(reference_out.values().shape, generator=gen)
    return {f: torch.randn(j.values.shape, generator=gen) for f, j in reference_out.items()}


def _loss(out, weights, pooled: bool):
    if pooled:
        return (out.values() * weights).sum()
    return sum((out[f].values * w).sum() for f, w in weights.items())


def _rank_slice(weights, parts, rank: int, pooled: bool):
    """The rows of the global output weights that belong to ``rank``'s samples."""
    if pooled:
        start = sum(p.batch_size for p in parts[:rank])
        return weights[start:start + parts[rank].batch_size]
    out = {}
    for feature, w in weights.items():
        start = sum(p[feature].values.numel() for p in parts[:rank])
        out[feature] = w[start:start + parts[rank][feature].values.numel()]
    return out


def _equivalence_worker(rank, world, group_size, placement, batch_sizes):
    dims = SparseParallelDims(world, group_size, placement)
    groups = MeshGroups.create(dims)
    checked = []
    for pooled in (True, False):
        reference = make_module(pooled, seed=3)
        batch = random_batch(sum(batch_sizes), seed=7)
        parts = batch.split_batch(batch_sizes)
        counter = ByteCounter(rank, world)
        sharded = shard_collection(reference, ShardingSpec(groups, backend="torch", counter=counter),
                                   plan=_plan(group_size))

        out = sharded(parts[rank])
        expected = reference(parts[rank])
        if pooled:
            torch.testing.assert_close(out.values(), expected.values(), atol=ATOL, rtol=0)
            assert out.keys() == expected.keys()
        else:
            for feature in expected:
                torch.testing.assert_close(out[feature].values, expected[feature].values, atol=ATOL, rtol=0)

        global_out = reference(batch)
        weights = _global_output_weights(global_out, pooled, seed=11)
        _loss(global_out, weights, pooled).backward()
        _loss(out, _rank_slice(weights, parts, rank, pooled), pooled).backward()

        for kernel, shards in sharded.kernel_shards():
            for shard, param in zip(shards, kernel.shard_weights, strict=True):
                grad = param.grad.to_dense() if param.grad is not None else torch.zeros_like(param)
                data_parallel = sharded.plan[shard.table].sharding_type == ShardingType.DATA_PARALLEL
                dist.all_reduce(grad, group=groups.world if data_parallel else groups.replica)
                full = getattr(reference, sharded.prefix)[shard.table].weight.grad
                expected_grad = full[shard.row_start:shard.row_end, shard.col_start:shard.col_end]
                torch.testing.assert_close(grad, expected_grad, atol=ATOL, rtol=0,
                                           msg=lambda m, s=shard: f"{s}: {m}")
                checked.append((pooled, shard.table, sharded.plan[shard.table].sharding_type.value))

        outside = [p for p in range(world) if p not in groups.shard_ranks]
        assert counter.total(peers=outside) == 0, "sparse traffic must stay inside the shard group"
        if group_size > 1:
            assert counter.total(names=["output_dist"]) > 0 and counter.total(names=["output_dist_grad"]) > 0
    return checked


@pytest.mark.parametrize(
    "world, group_size, placement, batch_sizes",
    [
        (4, 2, "contiguous", [3, 1, 4, 2]),
        (4, 4, "strided", [2, 5, 1, 3]),
        (8, 4, "strided", [2, 3, 1, 4, 2, 1, 3, 2]),
    ],
    ids=["2x2", "1x4", "2x4-strided"],
)
def test_sharded_matches_unsharded(world, group_size, placement, batch_sizes):
    checked = run_distributed(_equivalence_worker, world, group_size, placement, batch_sizes)
    seen = {(pooled, kind) for per_rank in checked for pooled, _, kind in per_rank}
    for pooled in (True, False):
        for kind in ShardingType:
            assert (pooled, kind.value) in seen, f"no {kind.value} shard checked (pooled={pooled})"
    tables_checked = {table for per_rank in checked for _, table, _ in per_rank}
    assert tables_checked == {name for name, *_ in POOLED_TABLES}


def _train_worker(rank, world, group_size, backend, optimizer_name, steps):
    groups = MeshGroups.create(SparseParallelDims(world, group_size))
    reference = make_module(True, seed=3)
    tables = {n: k for n, *_, k in POOLED_TABLES}
    tables["t_cw"] = "column_wise"
    spec = ShardingSpec(groups, SparseOptimizerConfig(optimizer_name, lr=0.1, eps=1e-3), grad_scale=1.0 / group_size,
                        backend=backend)
    sharded = shard_collection(reference, spec, plan=_plan(group_size))
    outputs = []
    for step in range(steps):
        batch = random_batch(4 * world, seed=100 + step).split_batch([4] * world)[rank]
        out = sharded(batch)
        outputs.append(out.values().detach().clone())
        out.values().pow(2).mean().backward()
        for kernel in sharded.kernels():
            kernel.step()
    weights = {str(shard): w.clone() for shard, w in sharded.local_shards()}
    states = [s.clone() for kernel in sharded.kernels() for s in kernel.optimizer_states()]
    return outputs, weights, states


@pytest.mark.parametrize("optimizer_name", ["rowwise_adagrad", "sgd"])
def test_fbgemm_matches_torch_reference_2x2(optimizer_name):
    pytest.importorskip("fbgemm_gpu")
    torch_run = run_distributed(_train_worker, 4, 2, "torch", optimizer_name, 3)
    fbgemm_run = run_distributed(_train_worker, 4, 2, "fbgemm", optimizer_name, 3)
    for (t_out, t_w, t_s), (f_out, f_w, f_s) in zip(torch_run, fbgemm_run, strict=True):
        for a, b in zip(t_out, f_out, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert t_w.keys() == f_w.keys()
        for key in t_w:
            torch.testing.assert_close(t_w[key], f_w[key], atol=1e-5, rtol=1e-5)
        assert len(t_s) == len(f_s) == (0 if optimizer_name == "sgd" else len(t_w))
        for a, b in zip(t_s, f_s, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert any((s > 0).any() for s in t_s) or optimizer_name == "sgd"


