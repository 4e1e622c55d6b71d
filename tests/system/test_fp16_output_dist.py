"""The output all-to-all of fp16 sequence tables: their rows go home as fp16, their gradients as ``comm_dtype``.

Two gloo processes (a 1D shard group of 2) train ``EmbeddingCollection`` twins with SGD for ``STEPS`` steps, once
as the engine is and once with the rows forced onto the ``comm_dtype`` wire (``sequence_wire_dtype`` patched to
None: the fp32 round trip). The rows of an fp16 table are fp16 values read in fp32, so the fp16 wire is exact:

* every output equals the unsharded collection's on the local batch bit for bit, and the outputs and trained
  rows equal the forced fp32 wire's bit for bit, for fp16 tables alone and mixed with fp32 tables (each dtype
  a part with its own all-to-all);
* the forward's bytes (``output_dist``) halve, the gradients' (``output_dist_grad``) stay fp32;
* with ``comm_dtype=bf16`` the fp16 rows still arrive exact (a bf16 wire would round them), the gradients halve;
* with per-id weights the rows are products that fp16 does not hold: they travel as ``comm_dtype``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_twod import EmbeddingCollection, EmbeddingTableConfig, SparseFeatures
from lightning_twod.core.shards import place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.sparse import output_dist
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed

WORLD, STEPS, BATCH = 2, 2, 6
# (name, rows, dim, features, dtype, sharding type)
TABLES = [
    ("h_tw", 37, 8, ["f_h_tw"], "fp16", "table_wise"),
    ("h_rw", 53, 8, ["f_h_rw", "f_h_rw2"], "fp16", "row_wise"),  # shared by two features
    ("h_cw", 29, 16, ["f_h_cw"], "fp16", "column_wise"),
    ("s_tw", 41, 8, ["f_s_tw"], "fp32", "table_wise"),
    ("s_rw", 23, 4, ["f_s_rw"], "fp32", "row_wise"),
]
MODULES = {"fp16": {"h_tw", "h_rw", "h_cw"}, "mixed": {t[0] for t in TABLES}}
# (module, comm_dtype, weighted)
RUNS = [("fp16", None, False), ("fp16", torch.bfloat16, False), ("fp16", None, True), ("mixed", None, False)]


def _collection(module: str) -> EmbeddingCollection:
    torch.manual_seed(7)
    return EmbeddingCollection([EmbeddingTableConfig(name, rows, dim, feats, pooling="none", dtype=dtype)
                                for name, rows, dim, feats, dtype, _ in TABLES if name in MODULES[module]])


def _batch(module: str, rank: int, step: int, weighted: bool) -> SparseFeatures:
    """Rank ``rank``'s bags (0 to 4 ids, empty ones included); weights in (0, 1) where ``weighted``."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    data, weights = {}, {}
    for name, rows, _, feats, _, _ in TABLES:
        for feature in feats if name in MODULES[module] else []:
            lengths = torch.randint(0, 5, (BATCH,), generator=gen)
            data[feature] = [torch.randint(0, rows, (int(n),), generator=gen).tolist() for n in lengths]
            weights[feature] = [torch.rand(int(n), generator=gen).tolist() for n in lengths]
    return SparseFeatures.from_dict(data, weights=weights if weighted else None)


def _train(groups: MeshGroups, rank: int, module: str, comm_dtype, weighted: bool) -> dict:
    reference = _collection(module)
    tables = [t for t in TABLES if t[0] in MODULES[module]]
    plan = place_tables([(n, r, d) for n, r, d, *_ in tables], WORLD, {n: kind for n, *_, kind in tables})
    counter = ByteCounter(rank, WORLD)
    spec = ShardingSpec(groups, SparseOptimizerConfig("sgd", lr=0.5), backend="torch", comm_dtype=comm_dtype,
                        counter=counter)
    sharded = shard_collection(reference, spec, plan=plan)
    start = [weight.clone() for part in sharded.parts() for _, weight in part.local_shards()]
    outputs, unsharded = [], []
    for step in range(STEPS):
        batch = _batch(module, rank, step, weighted)
        out = sharded(batch)
        outputs.append({f: out[f].values.detach().clone() for f in out})
        with torch.no_grad():
            unsharded.append({f: v.values.clone() for f, v in reference(batch).items()})
        gen = torch.Generator().manual_seed(1000 + 10 * step + rank)
        sum((v.values * torch.randn(v.values.shape, generator=gen)).sum() for v in out.values()).backward()
        for part in sharded.parts():
            for kernel in part.kernels():
                kernel.step()
        with torch.no_grad():
            reference.load_state_dict(sharded.state_dict())  # the next step's oracle reads the trained rows
    rows = {str(shard): weight.clone() for part in sharded.parts() for shard, weight in part.local_shards()}
    moved = any(not torch.equal(a, b) for a, b in zip(start, rows.values(), strict=True))
    return dict(outputs=outputs, unsharded=unsharded, rows=rows, moved=moved, bytes=counter.by_name())


def _worker(rank: int, world: int) -> dict:
    groups = MeshGroups.create(SparseParallelDims(world, world))
    runs = {}
    for run in RUNS:
        runs[run, "fp16 wire"] = _train(groups, rank, *run)
        engine = output_dist.sequence_wire_dtype
        output_dist.sequence_wire_dtype = lambda module, received: None  # the rows on the comm_dtype wire
        try:
            runs[run, "comm_dtype wire"] = _train(groups, rank, *run)
        finally:
            output_dist.sequence_wire_dtype = engine
    return runs


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout=300)


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and a, what
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{what} {key}"


@pytest.mark.parametrize("module", list(MODULES))
def test_fp16_rows_arrive_exact_and_train_as_on_the_fp32_wire(runs, module):
    run = (module, None, False)
    for rank, result in enumerate(runs):
        new, old = result[run, "fp16 wire"], result[run, "comm_dtype wire"]
        for step in range(STEPS):
            _equal(new["outputs"][step], new["unsharded"][step], f"rank {rank} step {step} against unsharded")
            _equal(new["outputs"][step], old["outputs"][step], f"rank {rank} step {step} against the fp32 wire")
        _equal(new["rows"], old["rows"], f"rank {rank} trained rows")
        assert {str(w.dtype) for w in new["rows"].values()} == ({"torch.float16"} if module == "fp16" else
                                                              {"torch.float16", "torch.float32"})
        assert new["moved"], f"rank {rank}: no row trained"


def test_the_forward_of_fp16_rows_sends_half_the_bytes_and_the_gradients_fp32(runs):
    run = ("fp16", None, False)
    forward = grads = 0
    for rank, result in enumerate(runs):
        new, old = result[run, "fp16 wire"]["bytes"], result[run, "comm_dtype wire"]["bytes"]
        assert new["output_dist"] * 2 == old["output_dist"] > 0, rank
        assert new["output_dist_grad"] == old["output_dist_grad"] > 0, rank
        assert new["input_dist"] == old["input_dist"] > 0, rank
        forward, grads = forward + new["output_dist"], grads + new["output_dist_grad"]
    assert forward * 2 == grads  # every row that went home as fp16 came back as an fp32 gradient


def test_a_mixed_module_sends_only_its_fp16_tables_rows_as_fp16(runs):
    run = ("mixed", None, False)
    for rank, result in enumerate(runs):
        new, old = result[run, "fp16 wire"]["bytes"], result[run, "comm_dtype wire"]["bytes"]
        assert old["output_dist"] / 2 < new["output_dist"] < old["output_dist"], rank
        assert new["output_dist_grad"] == old["output_dist_grad"] > 0, rank


def test_a_bf16_comm_dtype_leaves_fp16_rows_exact_and_halves_their_gradients(runs):
    run, fp32 = ("fp16", torch.bfloat16, False), ("fp16", None, False)
    rounded = False
    for rank, result in enumerate(runs):
        new, old, exact = result[run, "fp16 wire"], result[run, "comm_dtype wire"], result[fp32, "fp16 wire"]
        _equal(new["outputs"][0], exact["outputs"][0], f"rank {rank}: the first step's rows on the bf16 comm_dtype")
        rounded |= any(not torch.equal(old["outputs"][0][f], exact["outputs"][0][f]) for f in exact["outputs"][0])
        assert new["bytes"]["output_dist"] == exact["bytes"]["output_dist"] > 0, rank
        assert new["bytes"]["output_dist_grad"] * 2 == exact["bytes"]["output_dist_grad"] > 0, rank
    assert rounded, "a bf16 wire must round some fp16 row: the check would see nothing"


def test_weighted_rows_are_not_fp16_values_and_travel_as_comm_dtype(runs):
    run = ("fp16", None, True)
    for rank, result in enumerate(runs):
        new, old = result[run, "fp16 wire"], result[run, "comm_dtype wire"]
        assert new["bytes"] == old["bytes"] and new["bytes"]["output_dist"] > 0, rank
        for step in range(STEPS):
            _equal(new["outputs"][step], new["unsharded"][step], f"rank {rank} step {step} weighted")
