"""The planner's predictions against real sharded modules on 4 and 8 gloo processes.

One spawn per world size; inside it, for 1D and 2D layouts with contiguous and strided placement,
every rank builds the planner's plan, shards two collections with it (pooled + weighted, and
unpooled), runs training steps with a replica reduction after each, and compares:

* the ``ByteCounter`` bytes of every collective with ``predict_traffic`` (within 5 %);
* the bytes its kernels allocate (weights + optimizer state, torch and FBGEMM backends) and the
  step tensors (ids received, kernel output, collection output) with ``predict_storage``;
* the plan (as YAML) with every other rank's: plans must be identical on every rank.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from lightning_twod.core.features import SparseFeatures
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.planner import PlanRequest, TableSpec, Workload, plan_for_strategy, predict_storage, predict_traffic
from lightning_twod.planner.inputs import SYNC_BYTES
from lightning_twod.replication import ReplicaReducer, ReplicatedKernel
from lightning_twod.sparse.kernels import fbgemm_available
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingCollection, EmbeddingTableConfig
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed

BATCH = 48  # samples per rank
STEPS = 2
TOLERANCE = 0.05
STRATA = 8  # a multiple of every group size tested, so strata align with row-wise blocks
# (name, rows, dim, features, ids per sample per feature)
POOLED = [
    ("tw_a", 3000, 16, 1, 3),
    ("rw", 4000, 8, 2, 4),  # a shared table, row-wise
    ("cw", 2000, 32, 1, 2),  # column-wise
    ("dp", 56, 8, 1, 2),  # data-parallel
    ("tw_b", 504, 12, 1, 5),
]
UNPOOLED = [
    ("seq_a", 1000, 8, 1, 3),
    ("seq_rw", 3000, 16, 1, 2),
]
CONSTRAINTS = {"rw": "row_wise", "cw": "column_wise", "dp": "data_parallel", "seq_rw": "row_wise"}


def _configs(tables, pooled: bool) -> list[EmbeddingTableConfig]:
    return [EmbeddingTableConfig(name, rows, dim, [f"{name}_f{k}" for k in range(nf)],
                                 pooling="sum" if pooled else "none")
            for name, rows, dim, nf, _ in tables]


def _stats(tables, weighted: bool) -> dict[str, dict]:
    return {name: {"pooling_factor": float(ids), "weighted": weighted} for name, _, _, _, ids in tables}


def _batch(tables, seed: int, weighted: bool) -> SparseFeatures:
    """``BATCH`` samples; every bag of a feature has exactly its pooling factor of ids.

    Ids are uniform, stratified over ``STRATA`` equal row ranges (id k of a feature falls in range
    ``k mod STRATA``, uniformly inside it): each row-wise block gets exactly its share of the ids,
    as the planner's expectation says, while repeats inside a block stay random. The comparison
    then measures the accounting, not the sampling noise of one small batch.
    """
    gen = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for name, rows, _, nf, ids in tables:
        assert rows % STRATA == 0
        for k in range(nf):
            keys.append(f"{name}_f{k}")
            count = BATCH * ids
            strata = (torch.arange(count) + seed) % STRATA
            inside = torch.randint(0, rows // STRATA, (count,), generator=gen)
            values.append(strata * (rows // STRATA) + inside)
            lengths.append(torch.full((BATCH,), ids, dtype=torch.int64))
    values_t = torch.cat(values)
    weights = torch.rand(values_t.numel(), generator=gen) if weighted else None
    return SparseFeatures(keys, values_t, torch.cat(lengths), weights)


def _kernel_bytes(kernel) -> int:
    tensors = list(kernel.parameters()) + list(kernel.buffers())
    if hasattr(kernel, "states"):
        tensors += [t for states in kernel.states for t in states.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _close(actual: float, predicted: float, what: str) -> float:
    error = abs(actual - predicted) / max(predicted, 1.0)
    assert error <= TOLERANCE, f"{what}: measured {actual:.0f} B, predicted {predicted:.0f} B ({error:.1%} off)"
    return error


def _worker(rank, world, layouts):
    torch.manual_seed(0)
    report = []
    collections = {"pooled": (POOLED, True, True), "seq": (UNPOOLED, False, False)}
    tables_by_module = {path: _configs(t, pooled) for path, (t, pooled, _) in collections.items()}
    stats = {**_stats(POOLED, True), **_stats(UNPOOLED, False)}
    for group_size, placement in layouts:
        dims = SparseParallelDims(world, group_size, placement, ranks_per_node=min(world, 4))
        groups = MeshGroups.create(dims)
        request = PlanRequest(world, 4, 2**30, Workload(batch_size=BATCH), group_size, placement, CONSTRAINTS,
                              stats=stats)
        result = plan_for_strategy(tables_by_module, request)
        # plans are identical on every rank (spawned processes: different hash seeds)
        text = result.plan.to_yaml()
        gathered = [None] * world
        dist.all_gather_object(gathered, text)
        assert all(t == text for t in gathered), "ranks computed different plans"

        counter = ByteCounter(rank, world)
        position = dims.shard_rank(rank)
        for path, (tables, pooled, weighted) in collections.items():
            cls = EmbeddingBagCollection if pooled else EmbeddingCollection
            module = cls(tables_by_module[path])
            specs = [TableSpec.from_config(c, float(ids), weighted) for c, (*_, ids) in zip(module.tables, tables)]
            plan = result.plans[path]
            sharded = shard_collection(module, ShardingSpec(groups, backend="torch", grad_scale=1 / group_size,
                                                            optimizer=SparseOptimizerConfig("rowwise_adagrad"),
                                                            counter=counter), plan=plan)
            replicated = []
            if sharded.kernel is not None:
                replicated.append(ReplicatedKernel(sharded.kernel, groups.replica, groups.replica_ranks))
            if sharded.local_kernel is not None:
                replicated.append(ReplicatedKernel(sharded.local_kernel, groups.world, list(range(world))))

            reducer = ReplicaReducer(replicated, counter=counter)
            # the int8 wire's bytes, counted apart: it reduces the same touched rows right after
            int8 = ReplicaReducer(replicated, "int8", counter=counter, name="replica_sync_int8")
            workload = Workload(batch_size=BATCH)
            storage = predict_storage(specs, plan, group_size, workload)[position]
            allocated = sum(_kernel_bytes(k) for k in sharded.kernels())
            report.append(("weights+state torch", _close(allocated, storage.weights + storage.optimizer, path)))
            if pooled and fbgemm_available():
                fb = shard_collection(module, ShardingSpec(groups, backend="fbgemm",
                                                           optimizer=SparseOptimizerConfig("rowwise_adagrad")),
                                      plan=plan)
                fb_bytes = sum(_kernel_bytes(k) for k in fb.kernels())
                report.append(("weights+state fbgemm",
                               _close(fb_bytes, storage.weights + storage.optimizer, path + " fbgemm")))

            # step tensors of one forward (no grad: it must not count as touching rows)
            features = _batch(tables, seed=1000 + rank, weighted=weighted)
            with torch.no_grad():
                _, received, owned, local = sharded.lookup_owned(features)
                out = sharded(features)
            got_ids = sum(t.numel() * t.element_size() for t in (received.values, received.lengths, received.weights)
                          if t is not None)
            report.append(("received ids", _close(got_ids, storage.received_ids, path + " received ids")))
            outs = ([owned] if owned is not None else []) + ([local] if local is not None else [])
            got_out = sum(sum(x.numel() for x in (o if isinstance(o, list) else [o])) for o in outs) * 4
            report.append(("lookup output", _close(got_out, storage.lookup_output, path + " lookup output")))
            numel = out.values().numel() if pooled else sum(j.values.numel() for j in out.values())
            report.append(("output", _close(numel * 4, storage.output, path + " output")))

            counter.reset()
            for step in range(STEPS):
                features = _batch(tables, seed=10 * step + rank, weighted=weighted)
                out = sharded(features)
                loss = out.values().sum() if pooled else sum(j.values.sum() for j in out.values())
                loss.backward()
                for kernel in sharded.kernels():
                    kernel.step()
                reducer.reduce()
                int8.reduce()
            predicted = predict_traffic(specs, plan, group_size, dims.num_replicas, workload, steps=STEPS)[position]
            int8_workload = replace(workload, sync_bytes=SYNC_BYTES["int8"])
            predicted["replica_sync_int8"] = predict_traffic(specs, plan, group_size, dims.num_replicas, int8_workload,
                                                             steps=STEPS)[position].get("replica_sync", 0.0)
            measured = counter.by_name()
            for name in sorted(set(predicted) | set(measured)):
                got, want = measured.get(name, 0), predicted.get(name, 0.0)
                if want == 0:
                    assert got == 0, f"{path} {name}: measured {got} B, predicted none"
                    continue
                error = _close(got, want, f"{path} {name} (S={group_size}, {placement}, rank {rank})")
                report.append((name, error))
    return report


@pytest.mark.parametrize("world, layouts", [
    (4, [(4, "contiguous"), (2, "contiguous"), (2, "strided")]),
    (8, [(8, "contiguous"), (4, "contiguous"), (2, "strided")]),
], ids=["4-proc", "8-proc"])
def test_predictions_match_real_runs(world, layouts):
    reports = run_distributed(_worker, world, layouts, timeout=240)
    names = {name for report in reports for name, _ in report}
    for name in ("input_dist", "output_dist", "output_dist_grad", "replica_sync", "replica_sync_int8",
                 "weights+state torch",
                 "received ids", "lookup output", "output"):
        assert name in names, f"{name} was never compared"
    worst = max(error for report in reports for _, error in report)
    print(f"world {world}: {sum(len(r) for r in reports)} comparisons, worst error {worst:.2%}")
    assert worst <= TOLERANCE
