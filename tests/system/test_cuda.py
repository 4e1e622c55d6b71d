"""The sharded engine and the strategy on a CUDA device (skipped without one; run by benchmarks/gpu.sh).

* Two processes share the one GPU over gloo (NCCL needs a GPU per rank): the sharded collections
  (every sharding type, pooled and unpooled, torch kernels, tensors on ``cuda:0``) give the unsharded
  module's outputs, and the unsharded gradients summed over each shard's copies.
* A one-process Lightning fit on the GPU trains the same weights as on the CPU.

Without pytest (``python tests/system/test_cuda.py``) the tests run with a plain runner.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]  # the repository

from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.sparse_cases import POOLED_TABLES, constraints, make_module, random_batch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ATOL = 1e-5
BATCH_SIZES = [5, 3]


def _engine_worker(rank: int, world: int, group_size: int) -> list[str]:
    import torch.distributed as dist

    from lightning_twod.core.shards import ShardingType, place_tables
    from lightning_twod.distributed import MeshGroups, SparseParallelDims
    from lightning_twod.sparse.sharded import ShardingSpec
    from lightning_twod.sparse.wrap import shard_collection

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    groups = MeshGroups.create(SparseParallelDims(world, group_size))
    plan = place_tables([(n, r, d) for n, r, d, *_ in POOLED_TABLES], group_size, constraints())
    checked = []
    for pooled in (True, False):
        reference = make_module(pooled, seed=3).to(device)
        batch = random_batch(sum(BATCH_SIZES), seed=7).to(device)
        parts = batch.split_batch(BATCH_SIZES)
        sharded = shard_collection(reference, ShardingSpec(groups, backend="torch", device=device), plan=plan)
        assert all(w.device.type == "cuda" for _, w in sharded.local_shards())
        out = sharded(parts[rank])
        expected = reference(parts[rank])
        # the global loss sum_r <out_r, G_r>, G the same on every rank
        gen = torch.Generator().manual_seed(11)
        if pooled:
            torch.testing.assert_close(out.values(), expected.values(), atol=ATOL, rtol=0)
            assert out.values().device.type == "cuda"
            weights = torch.randn(reference(batch).values().shape, generator=gen).to(device)
            start = sum(BATCH_SIZES[:rank])
            (reference(batch).values() * weights).sum().backward()
            (out.values() * weights[start:start + BATCH_SIZES[rank]]).sum().backward()
        else:
            full = reference(batch)
            weights = {f: torch.randn(j.values.shape, generator=gen).to(device) for f, j in full.items()}
            sum((full[f].values * w).sum() for f, w in weights.items()).backward()
            loss = 0
            for feature, w in weights.items():
                torch.testing.assert_close(out[feature].values, expected[feature].values, atol=ATOL, rtol=0)
                start = sum(p[feature].values.numel() for p in parts[:rank])
                loss = loss + (out[feature].values * w[start:start + out[feature].values.shape[0]]).sum()
            loss.backward()
        for kernel, shards in sharded.kernel_shards():
            for shard, param in zip(shards, kernel.shard_weights, strict=True):
                grad = param.grad.to_dense() if param.grad is not None else torch.zeros_like(param)
                data_parallel = sharded.plan[shard.table].sharding_type == ShardingType.DATA_PARALLEL
                group = groups.world if data_parallel else groups.replica
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(grad, group=group)  # gloo reduces CUDA tensors through the host
                want = getattr(reference, sharded.prefix)[shard.table].weight.grad
                torch.testing.assert_close(grad, want[shard.row_start:shard.row_end, shard.col_start:shard.col_end],
                                           atol=ATOL, rtol=0)
                checked.append(f"{pooled}:{sharded.plan[shard.table].sharding_type.value}")
    return checked


@pytest.mark.parametrize("group_size", [2, 1], ids=["1x2", "2x1"])
def test_sharded_engine_on_cuda_matches_unsharded(group_size):
    checked = run_distributed(_engine_worker, 2, group_size, timeout=300)
    kinds = {c for per_rank in checked for c in per_rank}
    assert {"True:table_wise", "True:row_wise", "True:column_wise", "True:data_parallel"} <= kinds
    assert {"False:table_wise", "False:row_wise"} <= kinds


def _fit_worker(rank: int, world: int, port: int, accelerator: str) -> dict:
    import lightning.pytorch as pl

    from lightning_twod import TwoDSparseStrategy
    from tests.helpers import strategy_cases as C

    C.as_external_rank(rank, world, port)
    lit = C.LitDLRM(C.make_net("collection"), 0.2, num_samples=6 * C.LOCAL_BATCH)
    strategy = TwoDSparseStrategy(shard_group_size=1, sparse_optimizer="rowwise_adagrad", sparse_lr=0.05,
                                  kernel_backend="torch")
    kwargs = C.trainer_kwargs(6)
    kwargs["accelerator"] = accelerator
    trainer = pl.Trainer(devices=1, strategy=strategy, **kwargs)
    trainer.fit(lit)
    devices = sorted({str(w.device.type) for m in strategy.sparse_modules.values() for _, w in m.local_shards()})
    return {"state": C.numpy_state(lit.net.state_dict()), "devices": devices, "steps": trainer.global_step}


def test_single_gpu_fit_matches_cpu_fit():
    from tests.helpers import strategy_cases as C

    gpu = run_distributed(_fit_worker, 1, C.free_port(), "gpu", timeout=300)[0]
    cpu = run_distributed(_fit_worker, 1, C.free_port(), "cpu", timeout=300)[0]
    assert gpu["devices"] == ["cuda"] and cpu["devices"] == ["cpu"]
    assert gpu["steps"] == cpu["steps"] == 6
    initial = C.make_net("collection").state_dict()
    for key, want in cpu["state"].items():
        got = torch.as_tensor(gpu["state"][key])
        torch.testing.assert_close(got, torch.as_tensor(want), atol=1e-4, rtol=1e-4)
    moved = max(float((torch.as_tensor(cpu["state"][k]) - initial[k]).abs().max()) for k in C.embedding_names(
        C.make_net("collection")))
    assert moved > 1e-3, "the tables hardly trained: the comparison would prove nothing"


if __name__ == "__main__":  # plain runner for machines without pytest
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        raise SystemExit(0)
    failures = 0
    cases = [(test_sharded_engine_on_cuda_matches_unsharded, {"group_size": 2}),
             (test_sharded_engine_on_cuda_matches_unsharded, {"group_size": 1}),
             (test_single_gpu_fit_matches_cpu_fit, {})]
    for fn, kwargs in cases:
        try:
            fn(**kwargs)
            print(f"PASSED {fn.__name__} {kwargs}")
        except Exception as err:  # report every case, fail at the end
            failures += 1
            print(f"FAILED {fn.__name__} {kwargs}: {err}")
    print(f"{len(cases) - failures} passed, {failures} failed")
    raise SystemExit(1 if failures else 0)
