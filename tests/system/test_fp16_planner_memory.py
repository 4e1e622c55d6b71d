"""The planner's memory account of fp16 tables (``planner/memory.py``) against real sharded modules on 4 gloo
processes, as ``test_planner_memory.py`` measures fp32 ones: the bytes of the shards' rows (2 an element),
their fp32 optimizer state and the reduction's buffers (an fp16 table's rows in a round of their own, as they
are, whatever the wire) after a forward, a backward and a round, within the same tolerance.
"""

from __future__ import annotations

import pytest
import torch

from lightning_twod.core.shards import place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.planner import PlanRequest, TableSpec, Workload, plan_for_strategy
from lightning_twod.planner.inputs import SYNC_BYTES
from lightning_twod.planner.memory import plan_memory
from lightning_twod.planner.storage import predict_storage
from lightning_twod.replication import ReplicaReducer, ReplicatedKernel
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingTableConfig
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed
from tests.system.test_planner_memory import BATCH, TABLES, TOLERANCE, _batch, _bytes

DTYPES = {"a": "fp16", "b": "fp16", "c": "fp32", "d": "fp16"}  # "b" row-wise; "c" keeps fp32 rows beside them
CHECKED = ("table_shards", "optimizer_state", "reduction")
# (shard group size, placement, sync_dtype, overlap, optimizer)
LAYOUTS = [(2, "contiguous", "fp32", False, "rowwise_adagrad"), (2, "strided", "bf16", False, "rowwise_adagrad"),
           (1, "contiguous", "fp32", True, "rowwise_adagrad"), (2, "contiguous", "int8", True, "rowwise_adagrad"),
           (2, "contiguous", "bf16", True, "rowwise_adam"), (2, "contiguous", "fp32", False, "sgd")]


def _measure(rank: int, world: int, size: int, placement: str, sync_dtype: str, overlap: bool,
             optimizer: str) -> dict[str, tuple[float, float]]:
    configs = [EmbeddingTableConfig(n, rows, dim, [f"f_{n}"], dtype=DTYPES[n]) for n, rows, dim, _ in TABLES]
    dims = SparseParallelDims(world, size, placement, ranks_per_node=4)
    groups = MeshGroups.create(dims)
    stats = {n: {"pooling_factor": float(i)} for n, _, _, i in TABLES}
    workload = Workload(batch_size=BATCH, optimizer=optimizer, sync_bytes=SYNC_BYTES[sync_dtype], sync_overlap=overlap)
    result = plan_for_strategy({"sparse": configs}, PlanRequest(world, 4, 2**30, workload, size, placement,
                                                                {"b": "row_wise"}, stats=stats))
    torch.manual_seed(0)
    # one part per dtype (each its own kernels), as the strategy builds them
    spec = ShardingSpec(groups, SparseOptimizerConfig(optimizer), grad_scale=1 / size, backend="torch")
    module = shard_collection(EmbeddingBagCollection(configs), spec, plan=result.plans["sparse"])
    replicated = []
    for part in module.parts():
        if part.kernel is not None:
            replicated.append(ReplicatedKernel(part.kernel, groups.replica, groups.replica_ranks))
        if part.local_kernel is not None:
            replicated.append(ReplicatedKernel(part.local_kernel, groups.world, list(range(world))))
    reducer = ReplicaReducer(replicated, sync_dtype)
    module(_batch(rank)).values().sum().backward()
    kernels = [k for part in module.parts() for k in part.kernels()]
    for kernel in kernels:
        kernel.step()
    if overlap:
        reducer.launch()
        reducer.finish()
    else:
        reducer.reduce()
    reduction = sum(_bytes(*g.workspace.buffers.values()) for g in reducer.groups)
    reduction += sum(_bytes(*tensors) for g in reducer.groups for kept in (g.references, g.residuals)
                     for kernel in kept for tensors in kernel)
    measured = {
        "table_shards": _bytes(*(w for k in kernels for w in k.weights())),
        "optimizer_state": _bytes(*(s for k in kernels for states in k.shard_states() for s in states.values())),
        "reduction": reduction,
        "half rows": _bytes(*(w for k in kernels for w in k.weights() if w.dtype == torch.float16)),
    }
    specs = {"sparse": [TableSpec.from_config(c, float(i)) for c, (*_, i) in zip(configs, TABLES)]}
    predicted = plan_memory(specs, result.plan.modules, size, dims.num_replicas, workload)[dims.shard_rank(rank)]
    out = {name: (measured[name], getattr(predicted, name)) for name in CHECKED}
    out["half rows"] = (measured["half rows"], None)
    return out


def _worker(rank: int, world: int) -> dict:
    return {layout: _measure(rank, world, *layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_worker, 4, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(map(str, layout)) for layout in LAYOUTS])
def test_the_memory_account_of_fp16_tables_matches_real_tensors(measured, layout):
    assert any(result[layout]["half rows"][0] > 0 for result in measured), "some rank holds fp16 rows"
    for rank, result in enumerate(measured):
        for name in CHECKED:
            got, want = result[layout][name]
            if want == 0:
                assert got == 0, f"rank {rank} {name}: measured {got} B, predicted none"
                continue
            error = abs(got - want) / want
            assert error <= TOLERANCE, f"rank {rank} {layout} {name}: measured {got} B, predicted {want:.0f} B ({error:.1%})"


def test_an_fp16_tables_rows_count_two_bytes_an_element_and_its_state_four():
    half, full = (TableSpec.from_config(EmbeddingTableConfig("t", 100, 8, dtype=dtype)) for dtype in ("fp16", "fp32"))
    assert (half.row_bytes, full.row_bytes) == (2, 4)
    plan = place_tables([("t", 100, 8)], 1)
    workload = Workload(batch_size=4, optimizer="rowwise_adagrad")
    (stored_half,), (stored_full,) = (predict_storage([spec], plan, 1, workload) for spec in (half, full))
    assert stored_half.weights == 100 * 8 * 2 and stored_full.weights == 100 * 8 * 4
    assert stored_half.optimizer == stored_full.optimizer == 100 * 4
