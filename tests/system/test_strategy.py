"""End-to-end tests of ``TwoDSparseStrategy``: Lightning fits on 4 CPU processes (gloo).

Two ways to run a 4-process fit inside pytest (never Lightning's popen launcher, which would re-run
pytest in its children):

* ``TwoDSparseStrategy(start_method="spawn")``: Lightning spawns the ranks; after ``fit`` the
  parent's module holds the trained full tables (the launcher's return path);
* ``run_distributed`` children that pose as externally launched ranks (``as_external_rank``):
  Lightning reuses their process group, and every rank can be inspected and report back. Several
  fits share one set of processes, since starting them costs far more than a 20-step fit.

The oracle throughout is a single-process plain-torch run of a copy of the unsharded net on the
concatenated global batches (``strategy_cases.train_reference``).
"""

from __future__ import annotations

import math
import os
import time
import traceback
from functools import cache

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_twod import TwoDSparseStrategy
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

STEPS = 20
GLOBAL = C.WORLD * C.LOCAL_BATCH  # samples per optimizer step over all ranks
LR = 0.2  # dense SGD, and the sparse lr of the SGD runs
ADA_LR = 0.05  # sparse lr of the row-wise AdaGrad runs
EPS = 1e-3  # large enough that a wrong eps scaling shows (row gradients are ~1e-3..1e-2)
ATOL = 1e-5


@cache
def reference(kind: str, sparse: SparseOptimizerConfig | None) -> dict[str, torch.Tensor]:
    return C.train_reference(C.make_net(kind), STEPS, GLOBAL, LR, sparse)


def initial_state(kind: str) -> dict[str, torch.Tensor]:
    return C.make_net(kind).state_dict()


def as_tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v) for k, v in state.items()}


def assert_same_weights(got: dict, want: dict, initial: dict, atol: float = ATOL) -> None:
    """Same keys, every tensor within ``atol``; and training moved every table by far more than that."""
    got, want = as_tensors(got), as_tensors(want)
    assert sorted(got) == sorted(want)
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= atol, f"{key}: max |difference| {diff:.3g} > {atol}"
    for key in C.embedding_names(C.make_net("plain" if "t_user.weight" in want else "collection")):
        moved = (want[key] - initial[key]).abs().max().item()
        assert moved > 100 * atol, f"{key} hardly trained ({moved:.3g}): the comparison would prove nothing"


# ----------------------------------------------------------------------------- 1. SGD, spawn launcher
def test_spawn_2x2_sgd_matches_single_process_torch():
    lit = C.LitDLRM(C.make_net("collection"), LR, num_samples=STEPS * GLOBAL)
    strategy = TwoDSparseStrategy(shard_group_size=2, sparse_optimizer="sgd", sparse_lr=LR, sync_interval=1,
                                  start_method="spawn")
    trainer = pl.Trainer(devices=C.WORLD, strategy=strategy, **C.trainer_kwargs(STEPS))
    trainer.fit(lit)
    # The launcher brings back the progress and rank 0's state dict (full tables, unsharded keys).
    assert trainer.global_step == STEPS
    assert_same_weights(lit.net.state_dict(), reference("collection", None), initial_state("collection"))


# ----------------------------------------------------------------------------- fits sharing processes
FITS = {
    # criterion 1: 1D, and plain nn.EmbeddingBag attributes
    "sgd_1x4": dict(kind="collection", shard_group_size=4,
                    strategy=dict(sparse_optimizer="sgd", sparse_lr=LR, sync_interval=1)),
    "sgd_plain_2x2": dict(kind="plain", shard_group_size=2,
                          strategy=dict(sparse_optimizer="sgd", sparse_lr=LR, sync_interval=1)),
    # criterion 2: every-step gradient all-reduce under row-wise AdaGrad
    # (row-wise AdaGrad ignores a gradient's scale but for eps: a large eps makes a wrong scale show)
    "grad_adagrad_2x2": dict(kind="collection", shard_group_size=2,
                             strategy=dict(sync_mode="gradients", sparse_optimizer="rowwise_adagrad", sparse_lr=ADA_LR,
                                           sparse_eps=EPS)),
    "grad_adagrad_1x4": dict(kind="collection", shard_group_size=4,
                             strategy=dict(sync_mode="gradients", sparse_optimizer="rowwise_adagrad", sparse_lr=ADA_LR,
                                           sparse_eps=EPS)),
    # gradient accumulation (torch kernels: sparse gradients add up like dense ones): 2 micro-batches
    # per optimizer step equal one step on both global batches together
    "accumulate_2x2": dict(kind="collection", shard_group_size=2, accumulate=2,
                           strategy=dict(sparse_optimizer="sgd", sparse_lr=LR, kernel_backend="torch")),
    # criterion 3: momentum scale "auto" (= 2 replicas) on the torch kernel vs rescaled plain
    # row-wise AdaGrad on the default (FBGEMM when available) kernel
    "momentum_2x2": dict(kind="collection", shard_group_size=2,
                         strategy=dict(sparse_optimizer="momentum_rowwise_adagrad", sparse_lr=ADA_LR, sparse_eps=EPS,
                                       kernel_backend="torch")),
    "rescaled_rowwise_2x2": dict(kind="collection", shard_group_size=2,
                                 strategy=dict(sparse_optimizer="rowwise_adagrad", sparse_lr=ADA_LR * math.sqrt(2),
                                               sparse_eps=EPS * math.sqrt(2))),
}


def _fits_worker(rank: int, world_size: int, port: int, fits: dict) -> dict:
    C.as_external_rank(rank, world_size, port)
    out = {}
    for name, fit in fits.items():
        start = time.perf_counter()
        try:
            accumulate = fit.get("accumulate", 1)
            lit = C.LitDLRM(C.make_net(fit["kind"]), LR, num_samples=STEPS * GLOBAL * accumulate)
            strategy = TwoDSparseStrategy(shard_group_size=fit["shard_group_size"], **fit["strategy"])
            trainer = pl.Trainer(devices=world_size, strategy=strategy, accumulate_grad_batches=accumulate,
                                 **C.trainer_kwargs(STEPS))
            trainer.fit(lit)
            out[name] = dict(
                state=C.numpy_state(lit.net.state_dict()),  # a collective: full tables on every rank
                seen=lit.seen, global_step=trainer.global_step,
                momentum_scale=strategy.sparse_optimizer_config().momentum_scale,
                kernels=sorted({type(r.kernel).__name__ for r in strategy._replicated}),
                data_parallel=any(m.local_kernel is not None for m in strategy.sparse_modules.values()),
                reducer=strategy.reducer is not None, seconds=time.perf_counter() - start, error=None,
            )
        except Exception:  # the same on every rank for a deterministic failure: later fits still run
            out[name] = dict(error=traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def fits() -> dict[str, list[dict]]:
    """``{fit name: [result of rank 0, ..., rank 3]}``."""
    results = run_distributed(_fits_worker, C.WORLD, C.free_port(), FITS, timeout=300)
    for name in FITS:
        print(f"{name}: " + ", ".join(f"{r[name].get('seconds', float('nan')):.1f}s" for r in results))
    return {name: [r[name] for r in results] for name in FITS}


def fit_result(fits: dict, name: str) -> list[dict]:
    ranks = fits[name]
    for rank, result in enumerate(ranks):
        assert result["error"] is None, f"{name} failed on rank {rank}:\n{result['error']}"
        assert result["global_step"] == STEPS
    for other in ranks[1:]:  # state_dict() assembles the same full tables on every rank
        for key, value in ranks[0]["state"].items():
            np.testing.assert_array_equal(other["state"][key], value)
    return ranks


def test_sampler_gives_each_step_a_contiguous_global_batch(fits):
    ranks = fit_result(fits, "sgd_1x4")
    for rank, result in enumerate(ranks):
        assert len(result["seen"]) == STEPS
        for step, ids in enumerate(result["seen"]):
            assert ids == list(range(step * GLOBAL + rank, (step + 1) * GLOBAL, C.WORLD))
    for step in range(STEPS):
        union = sorted(i for result in ranks for i in result["seen"][step])
        assert union == list(range(step * GLOBAL, (step + 1) * GLOBAL))


def test_sgd_1x4_matches_single_process_torch(fits):
    rank0 = fit_result(fits, "sgd_1x4")[0]
    # 1D: a round only for data-parallel tables (no other copies); 2D: always
    assert rank0["reducer"] == rank0["data_parallel"] and fit_result(fits, "sgd_plain_2x2")[0]["reducer"]
    assert_same_weights(rank0["state"], reference("collection", None), initial_state("collection"))


def test_sgd_plain_embedding_bags_2x2_matches_single_process_torch(fits):
    rank0 = fit_result(fits, "sgd_plain_2x2")[0]
    assert set(rank0["state"]) >= {"t_user.weight", "t_item.weight", "t_cat.weight"}
    assert_same_weights(rank0["state"], reference("plain", None), initial_state("plain"))


def test_gradient_sync_rowwise_adagrad_2x2_equals_1x4_equals_torch(fits):
    two_d = fit_result(fits, "grad_adagrad_2x2")[0]
    one_d = fit_result(fits, "grad_adagrad_1x4")[0]
    assert two_d["kernels"] == one_d["kernels"] == ["TorchKernel"]  # gradients mode runs the torch kernels
    want = reference("collection", SparseOptimizerConfig("rowwise_adagrad", ADA_LR, EPS))
    assert_same_weights(two_d["state"], one_d["state"], initial_state("collection"))
    assert_same_weights(two_d["state"], want, initial_state("collection"))
    assert_same_weights(one_d["state"], want, initial_state("collection"))


def test_gradient_accumulation_with_torch_kernels_matches_the_doubled_batch(fits):
    rank0 = fit_result(fits, "accumulate_2x2")[0]
    assert rank0["kernels"] == ["TorchKernel"]
    doubled = C.train_reference(C.make_net("collection"), STEPS, 2 * GLOBAL, LR, None)
    assert_same_weights(rank0["state"], doubled, initial_state("collection"))


def test_momentum_rowwise_adagrad_equals_rescaled_rowwise_adagrad(fits):
    momentum = fit_result(fits, "momentum_2x2")
    rescaled = fit_result(fits, "rescaled_rowwise_2x2")
    assert all(r["momentum_scale"] == 2 for r in momentum)  # "auto": the number of replica groups
    assert momentum[0]["kernels"] == ["TorchKernel"]
    assert_same_weights(momentum[0]["state"], rescaled[0]["state"], initial_state("collection"))


# ----------------------------------------------------------------------------- 4. sync_interval > 1
INTERVAL = 3
SYNC_STEPS = 7
ROW_SCALE = 50  # tables of 2000, 3000 and 1200 rows: a step touches a few dozen


class ReductionProbe(TwoDSparseStrategy):
    """Checks every reduction against a whole-table average and records its rows and bytes."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reports: list[dict] = []

    def reduce_replicas(self, wait=None) -> int:
        expected = []
        for replicated in self._replicated:
            copies = [t.detach().clone() for t in C.copy_tensors(replicated)]
            for tensor in copies:  # raw collectives: not seen by the byte counter
                dist.all_reduce(tensor, group=replicated.group)
                tensor /= dist.get_world_size(replicated.group)
            expected.append(copies)
        before = self.byte_counter.by_name().get("replica_sync", 0)
        rows = super().reduce_replicas(wait)
        sent = self.byte_counter.by_name().get("replica_sync", 0) - before
        diff = max((got - want).abs().max().item() for replicated, copies in zip(self._replicated, expected)
                   for got, want in zip(C.copy_tensors(replicated), copies, strict=True))
        self.reports.append(dict(step=self.schedule.steps, rows=rows, last_sync_rows=self.last_sync_rows,
                                 bytes=sent, diff=diff,
                                 states=sum(len(r.kernel.optimizer_states()) for r in self._replicated),
                                 weights=sum(len(r.kernel.weights()) for r in self._replicated)))
        return rows


class ReplicaWatch(Callback):
    def __init__(self) -> None:
        self.per_step: list[tuple[int, list[bool]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        self.per_step.append((strategy.schedule.steps, C.replicas_identical(strategy)))


def _sync_interval_worker(rank: int, world_size: int, port: int, backends: list[str]) -> dict:
    C.as_external_rank(rank, world_size, port)
    out = {}
    for backend in backends:
        lit = C.LitDLRM(C.make_net("collection", row_scale=ROW_SCALE), LR, num_samples=SYNC_STEPS * GLOBAL,
                        row_scale=ROW_SCALE)
        strategy = ReductionProbe(shard_group_size=2, sync_mode="weights", sync_interval=INTERVAL,
                                  sparse_optimizer="rowwise_adagrad", sparse_lr=ADA_LR, kernel_backend=backend)
        watch = ReplicaWatch()
        trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=[watch],
                             **C.trainer_kwargs(SYNC_STEPS))
        trainer.fit(lit)
        out[backend] = dict(
            per_step=watch.per_step, final=C.replicas_identical(strategy), reports=strategy.reports,
            kernels=[type(r.kernel).__name__ for r in strategy._replicated],
            peers=[r.peers for r in strategy._replicated],
            replica_group=all(r.group is strategy.mesh_groups.replica for r in strategy._replicated),
            replica_ranks=strategy.mesh_groups.replica_ranks,
            table_bytes=sum(w.numel() + w.shape[0] for r in strategy._replicated for w in r.kernel.weights()) * 4,
            max_dim=max(w.shape[1] for r in strategy._replicated for w in r.kernel.weights()),
            shards=sum(len(r.kernel.weights()) for r in strategy._replicated),
        )
    return out


def test_sync_interval_reduces_touched_rows_only():
    from lightning_twod.sparse.kernels import fbgemm_available

    backends = ["torch"] + (["fbgemm"] if fbgemm_available() else [])
    results = run_distributed(_sync_interval_worker, C.WORLD, C.free_port(), backends, timeout=300)
    for backend in backends:
        for rank, result in enumerate(r[backend] for r in results):
            where = f"{backend}, rank {rank}"
            assert result["kernels"] and all(backend.lower() in k.lower() for k in result["kernels"]), where
            assert result["replica_group"] and all(p == result["replica_ranks"] for p in result["peers"]), where
            steps = [s for s, _ in result["per_step"]]
            assert steps == list(range(1, SYNC_STEPS + 1)), where
            for step, identical in result["per_step"]:
                if step % INTERVAL == 0:  # right after a reduction
                    assert all(identical), f"{where}: replicas differ right after the reduction of step {step}"
                else:
                    assert not any(identical), f"{where}: replicas already equal at step {step} (no reduction due)"
            assert all(result["final"]), f"{where}: replicas differ after training (the last, partial interval)"

            reports = result["reports"]
            assert [r["step"] for r in reports] == [3, 6, 7], where  # 7: on_train_end closes the partial interval
            for report in reports:
                print(f"{where}: reduction after step {report['step']}: {report['rows']} rows touched, "
                      f"{report['bytes']} bytes sent (whole local tables + state: {result['table_bytes']} bytes)")
                assert report["diff"] <= 1e-6, f"{where}: touched-row reduction != whole-table average"
                assert report["states"] == report["weights"] > 0, where  # row-wise AdaGrad states compared too
                assert report["rows"] == report["last_sync_rows"] > 0, where
                rows = report["rows"]
                payload = rows * (result["max_dim"] + 1) * 4
                ids = (rows + result["shards"]) * 8
                assert rows * 5 * 4 <= report["bytes"] <= 2 * payload + ids, f"{where}: {report}"
                assert report["bytes"] * 10 < result["table_bytes"], f"{where}: {report}"


# ----------------------------------------------------------------------------- 5. misconfiguration
@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(sparse_optimizer="adagrad"), r"sparse_optimizer='adagrad'; use one of \('sgd', 'rowwise_adagrad', 'momentum_rowwise_adagrad', 'adam'"),
    (dict(shard_group_size=0), r"shard_group_size=0; use a positive int or 'auto'"),
    (dict(sync_interval=0), r"sync_interval=0; use an int >= 1"),
    (dict(sync_mode="params"), r"sync_mode='params'; use one of"),
    (dict(sync_mode="gradients", kernel_backend="fbgemm"), r"use kernel_backend='torch' or 'auto'"),
    (dict(sparse_lr=0.0), r"lr > 0"),
])
def test_constructor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TwoDSparseStrategy(**kwargs)


def _misconfig_worker(rank: int, world_size: int, port: int) -> list[str]:
    C.as_external_rank(rank, world_size, port)
    cases = [  # (a group size that does not divide the world fails earlier, at Trainer(): tests/unit/test_options.py)
        (dict(shard_group_size=2), {}, C.NoTablesModule, MisconfigurationException,
         r"found no embedding tables in NoTablesModule.*strategy='ddp'"),
        (dict(shard_group_size=2, memory_per_rank_gb=1e-6), {}, None, MisconfigurationException,
         r"table 't_\w+' .* does not fit a shard group of 2 rank\(s\).*larger shard_group_size.*memory_per_rank_gb"),
        (dict(shard_group_size=2), dict(gradient_clip_val=1.0), None, MisconfigurationException,
         r"remove gradient_clip_val"),
        (dict(shard_group_size=2, sharding={"nope": "row_wise"}), {}, None, MisconfigurationException,
         r"sharding names unknown tables \['nope'\]; the model's tables are \['t_cat', 't_item', 't_user'\]"),
    ]
    messages = []
    for strategy_kwargs, trainer_extra, module_cls, error, match in cases:
        module = module_cls() if module_cls else C.LitDLRM(C.make_net(), LR, num_samples=GLOBAL * 2)
        trainer = pl.Trainer(devices=world_size, strategy=TwoDSparseStrategy(**strategy_kwargs),
                             **C.trainer_kwargs(2, **trainer_extra))
        with pytest.raises(error, match=match) as info:
            trainer.fit(module)
        assert trainer.global_step == 0  # failed at set-up, before any step
        messages.append(str(info.value))
    return messages


def test_misconfiguration_fails_at_setup_naming_the_fix():
    results = run_distributed(_misconfig_worker, C.WORLD, C.free_port(), timeout=240)
    assert len(results[0]) == 4
    assert all(r == results[0] for r in results)  # every rank fails with the same message


# ----------------------------------------------------------------------------- 6. one process
def test_single_process_matches_single_process_torch():
    environ = dict(os.environ)
    try:
        lit = C.LitDLRM(C.make_net("collection"), LR, batch_size=GLOBAL, num_samples=STEPS * GLOBAL)
        strategy = TwoDSparseStrategy(sparse_optimizer="sgd", sparse_lr=LR)
        trainer = pl.Trainer(devices=1, strategy=strategy, **C.trainer_kwargs(STEPS))
        trainer.fit(lit)
        assert strategy.mesh_groups.dims.world_size == strategy.mesh_groups.dims.shard_group_size == 1
        assert trainer.global_step == STEPS
        assert lit.seen == [list(range(s * GLOBAL, (s + 1) * GLOBAL)) for s in range(STEPS)]
        assert_same_weights(lit.net.state_dict(), reference("collection", None), initial_state("collection"))
    finally:
        # Lightning set up a 1-rank process group and DDP variables in this (pytest) process.
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
