"""What a drain after overlapped bf16 rounds holds, against the planner's account (``planner/memory.py``), on 4
gloo processes: the drain's blocking round sends every row the overlapped rounds left different since the
last round that waited, through the wire buffer those rounds share."""

from __future__ import annotations

import torch

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.reduction import GROWTH
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.planner import PlanRequest, TableSpec, Workload, plan_for_strategy
from lightning_twod.planner.memory import plan_memory
from lightning_twod.planner.reduction import reduction_rounds
from lightning_twod.replication import ReplicaReducer, ReplicatedKernel
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingTableConfig
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed

BATCH = 256
IDS = 8  # ids a sample: a step's round sends about a sixth of the rows, 30 rounds nearly all of them
ROUNDS = 30
TABLES = [("a", 40_000, 32), ("b", 40_000, 32)]
TOLERANCE = 0.05


def _batch(seed: int) -> SparseFeatures:
    gen = torch.Generator().manual_seed(seed)
    values = torch.cat([torch.randint(0, rows, (BATCH * IDS,), generator=gen) for _, rows, _ in TABLES])
    lengths = torch.full((len(TABLES) * BATCH,), IDS, dtype=torch.int64)
    return SparseFeatures([f"f_{n}" for n, *_ in TABLES], values, lengths)


def _worker(rank: int, world: int) -> dict[str, float]:
    """2 x 2, a bf16 round launched after every step and applied at the next launch, then a drain (what
    ``engine.drain`` runs). Bytes of the wire buffer before and after the drain, of a round's wire as the
    planner expects it (``reduction_rounds``), and the account's ``drain`` of that rank."""
    torch.manual_seed(0)
    configs = [EmbeddingTableConfig(n, rows, dim, [f"f_{n}"]) for n, rows, dim in TABLES]
    dims = SparseParallelDims(world, 2, "contiguous", ranks_per_node=4)
    groups = MeshGroups.create(dims)
    workload = Workload(batch_size=BATCH, sync_bytes=2, sync_overlap=True)
    stats = {n: {"pooling_factor": float(IDS)} for n, *_ in TABLES}
    result = plan_for_strategy({"sparse": configs}, PlanRequest(world, 4, 2**30, workload, 2, "contiguous",
                                                                stats=stats))
    spec = ShardingSpec(groups, SparseOptimizerConfig("rowwise_adagrad"), grad_scale=1 / 2, backend="torch")
    module = shard_collection(EmbeddingBagCollection(configs), spec, plan=result.plans["sparse"])
    reducer = ReplicaReducer([ReplicatedKernel(module.kernel, groups.replica, groups.replica_ranks)], "bf16")

    def wire() -> int:
        return sum(g.workspace.buffers["wire"].numel() * 2 for g in reducer.groups)

    for step in range(ROUNDS):
        module(_batch(rank + world * step)).values().sum().backward()
        for kernel in module.kernels():
            kernel.step()
        reducer.launch()
    reducer.finish()
    before = wire()
    assert reducer.unsettled
    reducer.reduce()  # the drain: every row the overlapped rounds sent since the last round that waited
    specs = [TableSpec.from_config(c, float(IDS)) for c in configs]
    position = dims.shard_rank(rank)
    account = plan_memory({"sparse": specs}, result.plan.modules, 2, dims.num_replicas, workload)[position]
    rounds, _ = reduction_rounds(specs, result.plan.modules["sparse"], 2, dims.num_replicas, workload)
    return {"before": before, "after": wire(), "round": rounds[position].elements * 2, "drain": account.drain,
            "drained_rows": reducer.last_rows, "rows": sum(rows for _, rows, _ in TABLES) // 2}


def test_a_drain_after_overlapped_bf16_rounds_grows_the_wire_as_the_account_says():
    for r in run_distributed(_worker, 4, timeout=300):
        assert r["drained_rows"] == r["rows"], r  # nearly every row was sent: the drain sends its shard whole
        assert r["before"] <= GROWTH * r["round"] * (1 + TOLERANCE), r  # a round's wire (grown once at most)
        assert r["after"] > 4 * r["before"], r
        # the account: the round's wire, and what the drain adds to it
        assert abs(r["after"] - (r["round"] + r["drain"])) <= TOLERANCE * r["after"], r
