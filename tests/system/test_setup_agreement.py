"""Set-up that every rank agrees on: one source for every copy, one plan, one kernel backend, and
any failure raised on every rank (none left waiting in a collective).

Each multi-process test here runs several fits in one set of gloo processes posing as torchrun
ranks (``strategy_cases.as_external_rank``). The strategies get a 600 s collective timeout, far
beyond the test's own: a rank left waiting would fail the test as a hang, not pass it late.
"""

from __future__ import annotations

import os
import tempfile

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision

from lightning_twod import TwoDSparseStrategy
from lightning_twod.distributed import consensus
from lightning_twod.sparse.kernels import fbgemm_available
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

HANG = 600.0  # the strategies' collective timeout: longer than any test waits
SHARDING = {"t_item": "row_wise", "t_cat": "data_parallel"}


class CopiesWatch(Callback):
    """Whether every copy of every shard, and the dense parameters, agree: after set-up and at the end."""

    def __init__(self) -> None:
        self.after_setup: list[bool] = []
        self.dense_after_setup = False

    def on_train_start(self, trainer, pl_module) -> None:
        self.after_setup = C.replicas_identical(trainer.strategy)
        dense = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        gathered = [torch.empty_like(dense) for _ in range(trainer.world_size)]
        torch.distributed.all_gather(gathered, dense)
        self.dense_after_setup = all(torch.equal(gathered[0], g) for g in gathered[1:])


# ----------------------------------------------------------------------------- 1. unseeded processes
def _unseeded_worker(rank: int, world_size: int, port: int) -> dict:
    C.as_external_rank(rank, world_size, port)
    out = {}
    for kind, backend, sharding in (("collection", "auto", SHARDING), ("plain", "torch", {})):
        net = C.make_net(kind, seed=100 + rank)  # each process draws its own weights, as without seed_everything
        own = {k: v.clone() for k, v in net.state_dict().items()}
        lit = C.LitDLRM(net, 0.2, num_samples=6 * world_size * C.LOCAL_BATCH)
        strategy = TwoDSparseStrategy(shard_group_size=2, sync_interval=2, sparse_optimizer="rowwise_adagrad",
                                      kernel_backend=backend, sharding=sharding, timeout=HANG)
        watch = CopiesWatch()
        trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=[watch], **C.trainer_kwargs(6))
        trainer.fit(lit)
        trained = lit.net.state_dict()  # a collective: full tables from replica 0
        out[kind] = dict(after_setup=watch.after_setup, dense_after_setup=watch.dense_after_setup,
                         at_end=C.replicas_identical(strategy), kernels=len(strategy._replicated),
                         own_differs=any(not torch.equal(own[k], trained[k]) for k in own))
    return out


def test_differently_seeded_processes_start_and_end_with_identical_copies():
    results = run_distributed(_unseeded_worker, 4, C.free_port(), timeout=300)
    for kind in ("collection", "plain"):
        for rank, result in enumerate(r[kind] for r in results):
            assert result["kernels"] >= 1
            assert result["after_setup"] and all(result["after_setup"]), f"{kind} rank {rank}: copies differ at set-up"
            assert result["dense_after_setup"], f"{kind} rank {rank}: dense parameters differ at set-up"
            assert all(result["at_end"]), f"{kind} rank {rank}: copies differ after training"


# ----------------------------------------------------------------------------- 2. set-up failures
class FailsOnOneRank(C.LitDLRM):
    """``configure_optimizers`` raises on rank 1 only (a user hook that fails on one node)."""

    def configure_optimizers(self):
        if self.global_rank == 1:
            raise RuntimeError("no optimizer on this node")
        return super().configure_optimizers()


def _fit(rank: int, world_size: int, steps: int = 2, module=None, trainer_extra=None, **strategy) -> TwoDSparseStrategy:
    module = module or C.LitDLRM(C.make_net(), 0.2, num_samples=steps * world_size * C.LOCAL_BATCH)
    strategy = TwoDSparseStrategy(timeout=HANG, **strategy)
    trainer = pl.Trainer(devices=world_size, strategy=strategy, **C.trainer_kwargs(steps, **(trainer_extra or {})))
    trainer.fit(module)
    return strategy


def _failure(call) -> dict:
    try:
        call()
    except Exception as err:  # noqa: BLE001 (reported to the test)
        return dict(type=type(err).__name__, message=str(err))
    return dict(type=None, message=None)


def _setup_worker(rank: int, world_size: int, port: int) -> dict:
    import lightning_twod.strategies.planning as strategy_module

    C.as_external_rank(rank, world_size, port)
    out = {}
    group = torch.distributed.group.WORLD

    def one_rank_raises():
        with consensus.raise_on_every_rank(group):
            if rank == 1:
                raise ValueError("table 't_user' is broken here")

    out["helper"] = _failure(one_rank_raises)
    out["plan_digest"] = _failure(lambda: consensus.check_same("plan", "B" if rank == 2 else "A", group))
    out["agree_min"] = consensus.agree_min([10.0 + rank, 5.0 - rank], group)

    if fbgemm_available():
        real = strategy_module.fbgemm_available
        strategy_module.fbgemm_available = (lambda: False) if rank == 2 else real  # one node without FBGEMM
        try:
            out["no_fbgemm_on_one_rank"] = _failure(lambda: _fit(rank, world_size, shard_group_size=2,
                                                                  kernel_backend="fbgemm"))
            fitted = _fit(rank, world_size, shard_group_size=2, kernel_backend="auto")
            out["auto_without_fbgemm_on_one_rank"] = sorted({type(r.kernel).__name__ for r in fitted._replicated})
        finally:
            strategy_module.fbgemm_available = real
        # t_cat (dim 4) cut column-wise in 2: widths 2, held by two ranks of each group only
        out["odd_widths_fbgemm"] = _failure(lambda: _fit(rank, world_size, shard_group_size=2,
                                                         kernel_backend="fbgemm", sharding={"t_cat": "column_wise"}))
        fitted = _fit(rank, world_size, shard_group_size=2, sharding={"t_cat": "column_wise"})
        out["odd_widths_auto"] = sorted({type(r.kernel).__name__ for r in fitted._replicated})
    module = FailsOnOneRank(C.make_net(), 0.2, num_samples=4 * world_size * C.LOCAL_BATCH)
    out["hook_fails_on_one_rank"] = _failure(lambda: _fit(rank, world_size, module=module, shard_group_size=2))
    # Trainer(precision="16-mixed") means bf16 on a CPU; the plugin itself scales the loss as on a GPU
    fp16 = MixedPrecision("16-mixed", "cpu")
    out["fp16_mixed"] = _failure(lambda: _fit(rank, world_size, shard_group_size=2,
                                              trainer_extra=dict(plugins=[fp16])))
    plain = C.LitDLRM(C.make_net("plain"), 0.2, num_samples=4 * world_size * C.LOCAL_BATCH)
    plain.net.t_cat.scale_grad_by_freq = True
    out["scale_grad_by_freq"] = _failure(lambda: _fit(rank, world_size, module=plain, shard_group_size=2))

    # a checkpoint file that one rank does not see (a node without the shared file system)
    path = os.path.join(tempfile.gettempdir(), f"twod-unseen-{port}.ckpt")
    if rank == 0:
        with open(path, "wb") as handle:
            handle.write(b"not read: set-up stops before")
    torch.distributed.barrier()
    real_isfile = os.path.isfile
    os.path.isfile = (lambda p: False if p == path else real_isfile(p)) if rank == 3 else real_isfile
    try:
        lit = C.LitDLRM(C.make_net(), 0.2, num_samples=2 * world_size * C.LOCAL_BATCH)
        trainer = pl.Trainer(devices=world_size, strategy=TwoDSparseStrategy(shard_group_size=2, timeout=HANG),
                             **C.trainer_kwargs(2))
        out["unseen_checkpoint"] = _failure(lambda: trainer.fit(lit, ckpt_path=path))
    finally:
        os.path.isfile = real_isfile

    # unequal memory readings (rank 3 has less): every rank plans with the smallest
    big = C.LitDLRM(C.make_net(row_scale=500), 0.2, num_samples=world_size * C.LOCAL_BATCH, row_scale=500)
    fitted = _fit(rank, world_size, steps=1, module=big, shard_group_size="auto", planner_batch_size=8,
                  memory_per_rank_gb=(8e5 if rank == 3 else 2e6) / 2**30)
    out["auto_group_size"] = fitted.mesh_groups.dims.shard_group_size
    return out


@pytest.fixture(scope="module")
def setup_results() -> list[dict]:
    return run_distributed(_setup_worker, 4, C.free_port(), timeout=400)


def _same_everywhere(results: list[dict], case: str) -> dict:
    first = results[0][case]
    for rank, result in enumerate(results):
        assert result[case] == first, f"{case}: rank {rank} got {result[case]}, rank 0 {first}"
    return first


def test_an_error_on_one_rank_raises_on_every_rank(setup_results):
    helper = _same_everywhere(setup_results, "helper")
    assert helper["type"] == "ValueError"
    assert "table 't_user' is broken here" in helper["message"] and "rank(s) [1]" in helper["message"]
    digest = _same_everywhere(setup_results, "plan_digest")
    assert digest["type"] == "RuntimeError" and "ranks [2]" in digest["message"]
    assert _same_everywhere(setup_results, "agree_min") == [10.0, 2.0]


def test_a_user_hook_failing_on_one_rank_stops_every_rank(setup_results):
    failure = _same_everywhere(setup_results, "hook_fails_on_one_rank")
    assert failure["type"] == "RuntimeError"
    assert "no optimizer on this node" in failure["message"] and "rank(s) [1]" in failure["message"]


@pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm_gpu (fbgemm-gpu-cpu)")
def test_the_kernel_backend_is_one_decision_for_every_rank(setup_results):
    missing = _same_everywhere(setup_results, "no_fbgemm_on_one_rank")
    assert missing["type"] == "MisconfigurationException" and "fbgemm_gpu does not import" in missing["message"]
    assert _same_everywhere(setup_results, "auto_without_fbgemm_on_one_rank") == ["TorchKernel"]
    odd = _same_everywhere(setup_results, "odd_widths_fbgemm")
    assert odd["type"] == "MisconfigurationException" and "multiples of 4, got shard dims [2]" in odd["message"]
    assert _same_everywhere(setup_results, "odd_widths_auto") == ["TorchKernel"]


def test_fp16_mixed_is_refused_naming_bf16_mixed(setup_results):
    failure = _same_everywhere(setup_results, "fp16_mixed")
    assert failure["type"] == "MisconfigurationException"
    assert "precision='16-mixed'" in failure["message"] and "bf16-mixed" in failure["message"]


def test_unrepresentable_module_fails_on_every_rank(setup_results):
    failure = _same_everywhere(setup_results, "scale_grad_by_freq")
    assert failure["type"] == "ValueError" and "'net.t_cat' has scale_grad_by_freq=True" in failure["message"]


def test_a_checkpoint_one_rank_cannot_read_stops_every_rank(setup_results):
    failure = _same_everywhere(setup_results, "unseen_checkpoint")
    assert failure["type"] == "FileNotFoundError"
    assert "no checkpoint at" in failure["message"] and "rank(s) [3]" in failure["message"]


def test_auto_group_size_is_planned_with_the_smallest_rank_memory(setup_results):
    # 2e6 bytes a rank would give groups of 2; rank 3's 8e5 bytes need groups of 4
    assert _same_everywhere(setup_results, "auto_group_size") == 4


