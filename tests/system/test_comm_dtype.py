"""``comm_dtype``: pooled embeddings and their gradients travel as bf16/fp16, the model stays fp32.

One set of 4 gloo processes (a 2x2 mesh) runs

* the sharded engine (every sharding type, weighted and mean-pooled features) once per wire type
  on the same batch and output gradient: outputs and row gradients of bf16/fp16 are within the
  rounding of that type of fp32's (exactly fp32's rounded to the type where one value crosses the
  wire: table-wise and column-wise sum pooling), and the output all-to-all's byte counters, forward
  and backward, are exactly half of fp32's while the ids' are unchanged;
* a short Lightning fit per wire type through ``TwoDSparseStrategy(comm_dtype=...)``: the option
  reaches the wire (bytes halve), and the trained weights stay close to fp32's.
"""

from __future__ import annotations

import pytest
import torch

from lightning_twod.core.shards import place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed
from tests.helpers.sparse_cases import POOLED_TABLES, constraints, make_module, random_batch

WIRE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Unit roundoff (half the spacing of numbers in [1, 2)) of each wire type.
UNIT = {"bf16": 2.0**-8, "fp16": 2.0**-11}
BATCH_SIZES = [3, 5, 2, 4]
FIT_STEPS = 4


def _engine(rank: int, world: int) -> dict:
    groups = MeshGroups.create(SparseParallelDims(world, 2))
    plan = place_tables([(n, r, d) for n, r, d, *_ in POOLED_TABLES], 2, constraints())
    batch = random_batch(sum(BATCH_SIZES), seed=21).split_batch(BATCH_SIZES)[rank]
    # Output gradients of order 10: well inside fp16's range, far above its subnormals.
    grad = None
    results = {}
    for name, dtype in [*WIRE.items(), ("fp32_abs", None)]:
        reference = make_module(True, seed=4)
        if name == "fp32_abs":  # |weights| and |output gradient|: sums of magnitudes, the rounding bounds
            with torch.no_grad():
                for param in reference.parameters():
                    param.abs_()
        counter = ByteCounter(rank, world)
        sharded = shard_collection(reference, ShardingSpec(groups, backend="torch", comm_dtype=dtype, counter=counter),
                                   plan=plan)
        out = sharded(batch)
        if grad is None:
            grad = 10 * torch.randn(out.values().shape, generator=torch.Generator().manual_seed(rank))
        out.values().backward(grad.abs() if name == "fp32_abs" else grad)
        grads = {}
        for kernel, shards in sharded.kernel_shards():
            for shard, param in zip(shards, kernel.shard_weights, strict=True):
                g = param.grad
                grads[str(shard)] = (g.to_dense() if g is not None else torch.zeros_like(param)).clone()
        results[name] = dict(
            out={f: out[f].detach().clone() for f in out.keys()},
            unsharded={f: v.detach().clone() for f, v in reference(batch).items()},
            grads=grads, bytes=counter.by_name(),
        )
    return results


def _fit(rank: int, world: int, port: int) -> dict:
    import lightning.pytorch as pl

    from lightning_twod import TwoDSparseStrategy
    from tests.helpers import strategy_cases as C

    C.as_external_rank(rank, world, port)
    results = {}
    for name in WIRE:
        lit = C.LitDLRM(C.make_net("collection"), 0.2, num_samples=FIT_STEPS * world * C.LOCAL_BATCH)
        strategy = TwoDSparseStrategy(shard_group_size=2, sparse_optimizer="sgd", sparse_lr=0.2, comm_dtype=name)
        trainer = pl.Trainer(devices=world, strategy=strategy, **C.trainer_kwargs(FIT_STEPS))
        trainer.fit(lit)
        wire = {m.comm_dtype for m in strategy.sparse_modules.values()}
        results[name] = dict(state=C.numpy_state(lit.net.state_dict()), bytes=strategy.byte_counter.by_name(),
                             wire=[str(w) for w in wire], steps=trainer.global_step)
    results["initial"] = C.numpy_state(C.make_net("collection").state_dict())
    return results


def _numpy(tree):
    """Tensors -> numpy copies: results travel through a queue from exiting children (no shared memory)."""
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return tree.detach().cpu().numpy().copy() if isinstance(tree, torch.Tensor) else tree


def _tensors(tree):
    if isinstance(tree, dict):
        return {k: _tensors(v) for k, v in tree.items()}
    return torch.as_tensor(tree) if hasattr(tree, "dtype") else tree


def _both(rank: int, world: int, port: int) -> dict:
    return {"engine": _numpy(_engine(rank, world)), "fit": _fit(rank, world, port)}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    from tests.helpers import strategy_cases as C

    results = run_distributed(_both, 4, C.free_port(), timeout=300)
    return [dict(r, engine=_tensors(r["engine"])) for r in results]


def _features(kind: str, pooling: str | None = None) -> list[str]:
    return [f for _, _, _, feats, pool, k in POOLED_TABLES if k == kind and pooling in (None, pool) for f in feats]


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_engine_outputs_within_rounding_of_fp32(runs, wire):
    unit, dtype = UNIT[wire], WIRE[wire]
    exact = _features("table_wise", "sum") + _features("column_wise", "sum")
    assert exact, "the cases must include sum-pooled table-wise and column-wise features"
    for rank, result in enumerate(r["engine"] for r in runs):
        fp32, low, magnitude = result["fp32"]["out"], result[wire]["out"], result["fp32_abs"]["out"]
        assert fp32.keys() == low.keys()
        for feature, want in fp32.items():
            torch.testing.assert_close(want, result["fp32"]["unsharded"][feature], atol=1e-6, rtol=0)
            # Each value crossing the wire is rounded once (relative error <= unit); a row-wise sum
            # of rounded partials errs by at most unit x the sum of its terms' magnitudes.
            error = (low[feature] - want).abs()
            bound = unit * magnitude[feature] + 1e-6
            assert bool((error <= bound).all()), f"rank {rank} {feature} ({wire}): {(error - bound).max():.3g} over"
        for feature in exact:  # exactly fp32's value rounded to the wire type and back
            torch.testing.assert_close(low[feature], fp32[feature].to(dtype).float(), atol=0, rtol=0)
        assert any(not torch.equal(low[f], fp32[f]) for f in exact), \
            f"rank {rank}: {wire} outputs equal fp32's bit for bit: nothing was rounded"
        for feature in _features("data_parallel"):  # looked up locally: never on the wire
            torch.testing.assert_close(low[feature], fp32[feature], atol=0, rtol=0)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_engine_gradients_within_rounding_of_fp32(runs, wire):
    unit = UNIT[wire]
    rounded = 0
    for rank, result in enumerate(r["engine"] for r in runs):
        fp32, low, magnitude = result["fp32"]["grads"], result[wire]["grads"], result["fp32_abs"]["grads"]
        assert fp32.keys() == low.keys() == magnitude.keys() and fp32
        for shard, want in fp32.items():
            # A row's gradient sums rounded output gradients: error <= unit x the sum of magnitudes.
            error = (low[shard] - want).abs()
            bound = unit * magnitude[shard] + 1e-5
            assert bool((error <= bound).all()), f"rank {rank} {shard} ({wire}): {(error - bound).max():.3g} over"
            rounded += not torch.equal(low[shard], want)
    assert rounded, f"{wire} gradients equal fp32's bit for bit: the backward wire was not rounded"


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_engine_output_bytes_halve_and_ids_do_not(runs, wire):
    for rank, result in enumerate(r["engine"] for r in runs):
        fp32, low = result["fp32"]["bytes"], result[wire]["bytes"]
        for name in ("output_dist", "output_dist_grad"):
            assert fp32[name] > 0, f"rank {rank}: no {name} bytes counted"
            assert low[name] * 2 == fp32[name], f"rank {rank} {name}: {low[name]} vs fp32 {fp32[name]}"
        assert low["input_dist"] == fp32["input_dist"] > 0  # ids and lengths stay int64


def test_strategy_comm_dtype_reaches_the_wire_and_trains_close_to_fp32(runs):
    for rank, fit in enumerate(r["fit"] for r in runs):
        assert all(fit[w]["steps"] == FIT_STEPS for w in WIRE)
        assert fit["fp32"]["wire"] == ["None"]
        assert fit["bf16"]["wire"] == ["torch.bfloat16"] and fit["fp16"]["wire"] == ["torch.float16"]
        for wire in ("bf16", "fp16"):
            for name in ("output_dist", "output_dist_grad"):
                assert fit[wire]["bytes"][name] * 2 == fit["fp32"]["bytes"][name] > 0, (rank, wire, name)
            assert fit[wire]["bytes"]["input_dist"] == fit["fp32"]["bytes"]["input_dist"]
            moved = differ = 0.0
            for key, want in fit["fp32"]["state"].items():
                moved = max(moved, float(abs(want - fit["initial"][key]).max()))
                differ = max(differ, float(abs(fit[wire]["state"][key] - want).max()))
            assert 0 < differ <= 0.05 * moved, f"rank {rank} {wire}: differs {differ:.3g}, trained {moved:.3g}"
