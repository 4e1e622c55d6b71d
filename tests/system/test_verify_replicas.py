"""``verify_replicas``: copies of replicated shards proven identical by digest, and caught when not.

2x2 fits and a Fabric loop (``shard_group_size=2``, contiguous: replica groups ``[0, 2]`` and
``[1, 3]``) of the strategy tests' DLRM, ``t_cat`` data-parallel (a copy on every rank). A strategy that moves one
element of one copy up by one ulp (``torch.nextafter``) on one rank right after a chosen reduction
stands in for a copy that diverged; the check must raise one ``ReplicaMismatchError`` on every rank,
naming the table and the ranks, at the point the option says; with nothing corrupted, no error.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod import TwoDSparseFabricStrategy, TwoDSparseStrategy
from lightning_twod.replication import ReplicaMismatchError
from lightning_twod.replication.verify import ReplicaCheck
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed
from tests.helpers.replication_cases import nudge

STEPS = 4
CORRUPT_RANK = 3  # its copy of a sharded table differs from rank 1's, its replica
SHARDING = {"t_cat": "data_parallel"}


def restore(tensor: torch.Tensor, value: float) -> None:
    tensor[(0,) * tensor.dim()] = value


def owned(strategy, kind: str) -> tuple[str, torch.Tensor]:
    """(table, tensor) of this rank's first owned shard: its weights or its row-wise state."""
    (module,) = strategy.sparse_modules.values()
    kernel, shards = module.kernel_shards()[0]
    assert shards[0].owner >= 0, "the first kernel holds sharded tables"
    tensors = kernel.weights() if kind == "weights" else kernel.optimizer_states()
    return shards[0].table, tensors[0]


class Corrupting(TwoDSparseStrategy):
    """Nudges one weight of rank ``CORRUPT_RANK``'s first owned shard right after reduction ``at``."""

    def __init__(self, at: int | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.corrupted, self.old = at, None, None

    def _reduced(self) -> None:
        if self.schedule.reductions + 1 == self.at and self.global_rank == CORRUPT_RANK:
            self.corrupted, weights = owned(self, "weights")
            self.old = nudge(weights)
        super()._reduced()


def _fit(rank: int, world_size: int, port: int, at: int | None, directory: str | None = None, **options) -> dict:
    """A 2x2 fit; the error it raised (message, the sparse step it came at), or None; and the strategy."""
    C.as_external_rank(rank, world_size, port)
    lit = C.LitDLRM(C.make_net("collection"), 0.2, num_samples=STEPS * world_size * C.LOCAL_BATCH)
    strategy = Corrupting(at, shard_group_size=2, sharding=SHARDING, **options)
    kwargs = C.trainer_kwargs(STEPS)
    callbacks = []
    if directory is not None:
        kwargs["enable_checkpointing"] = True
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1))
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=callbacks, **kwargs)
    error = None
    try:
        trainer.fit(lit)
    except ReplicaMismatchError as err:
        error = (str(err), strategy.schedule.steps)
    return dict(error=error, corrupted=strategy.corrupted, strategy=strategy)


def _every_reduction_worker(rank: int, world_size: int, port: int) -> dict:
    """``verify_replicas=1``, the copy nudged after the last reduction; then, after the fit, the copy
    restored, and the state and a data-parallel table nudged in turn."""
    fit = _fit(rank, world_size, port, at=STEPS, verify_replicas=1)
    strategy = fit.pop("strategy")
    messages, passed = {}, 0
    table, weights = owned(strategy, "weights")
    if rank == CORRUPT_RANK:
        restore(weights, strategy.old)
    strategy.check_replicas()  # identical again: no error
    passed += 1
    (module,) = strategy.sparse_modules.values()
    cases = {"state": (CORRUPT_RANK, lambda: owned(strategy, "state")[1]),
             "data_parallel": (2, lambda: module.local_kernel.weights()[0])}
    for name, (culprit, tensor_of) in cases.items():
        old = nudge(tensor_of()) if rank == culprit else None
        try:
            strategy.check_replicas()
        except ReplicaMismatchError as err:
            messages[name] = str(err)
        if rank == culprit:
            restore(tensor_of(), old)
    strategy.check_replicas()
    passed += 1
    return dict(fit, table=table, messages=messages, passed=passed)


@pytest.fixture(scope="module")
def every_reduction() -> list[dict]:
    return run_distributed(_every_reduction_worker, C.WORLD, C.free_port(), timeout=300)


def test_identical_copies_pass(every_reduction):
    for rank, result in enumerate(every_reduction):
        assert result["passed"] == 2, f"rank {rank}: a check of identical copies raised"


def test_every_reduction_check_names_table_and_ranks_on_every_rank(every_reduction):
    results = every_reduction
    table = results[CORRUPT_RANK]["corrupted"]
    assert table is not None
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not raise"
        message, step = result["error"]
        assert step == STEPS, f"rank {rank}: raised after sparse step {step}, not at the reduction of step {STEPS}"
        assert message == results[0]["error"][0], "one error, the same on every rank"
    message = results[0]["error"][0]
    assert f"table '{table}'" in message and "weights: ranks [3] differ from ranks [1]" in message, message
    assert message.count("differ") == 1, f"only the nudged copy is named: {message}"


def test_a_nudged_row_wise_state_is_caught(every_reduction):
    table = every_reduction[CORRUPT_RANK]["table"]
    for rank, result in enumerate(every_reduction):
        message = result["messages"].get("state")
        assert message is not None, f"rank {rank} did not raise"
        assert f"table '{table}'" in message, message
        assert "row-wise optimizer state: ranks [3] differ from ranks [1]" in message, message


def test_data_parallel_tables_are_compared_over_the_world(every_reduction):
    for rank, result in enumerate(every_reduction):
        message = result["messages"].get("data_parallel")
        assert message is not None, f"rank {rank} did not raise"
        assert "table 't_cat'" in message and "weights: ranks [2] differ from ranks [0, 1, 3]" in message, message


def _checkpoint_worker(rank: int, world_size: int, port: int, directory: str) -> dict:
    fit = _fit(rank, world_size, port, at=2, directory=directory)  # default: verify_replicas="checkpoint"
    fit.pop("strategy")
    return fit


def test_default_checks_before_a_checkpoint_and_writes_nothing(tmp_path):
    results = run_distributed(_checkpoint_worker, C.WORLD, C.free_port(), str(tmp_path), timeout=300)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not raise"
        message, step = result["error"]
        assert step == 2, f"rank {rank}: raised after sparse step {step}, not at the checkpoint of step 2"
        assert f"table '{results[CORRUPT_RANK]['corrupted']}'" in message and "ranks [3] differ" in message
    assert os.listdir(tmp_path) == [], "no checkpoint of diverged copies is written"


def _end_of_fit_worker(rank: int, world_size: int, port: int, at: int | None, verify) -> dict:
    fit = _fit(rank, world_size, port, at=at, verify_replicas=verify)
    fit.pop("strategy")
    return fit


@pytest.mark.parametrize("verify", ["checkpoint", "off"])
def test_the_end_of_fit_checks_unless_off(verify):
    results = run_distributed(_end_of_fit_worker, C.WORLD, C.free_port(), STEPS, verify, timeout=300)
    for rank, result in enumerate(results):
        if verify == "off":
            assert result["error"] is None, f"rank {rank}: {result['error']}"
        else:
            assert result["error"] is not None and result["error"][1] == STEPS, f"rank {rank}: {result['error']}"
            assert "ranks [3] differ from ranks [1]" in result["error"][0]


CONFIGS = [dict(sync_dtype="bf16", sync_interval=2), dict(sync_dtype="int8"),
           dict(sync_overlap=True, sync_interval=2), dict(sync_mode="gradients", kernel_backend="torch")]


def _configs_worker(rank: int, world_size: int, port: int) -> list[int]:
    C.as_external_rank(rank, world_size, port)
    verify, verified = ReplicaCheck.verify, []

    def counted(check: ReplicaCheck) -> None:  # this process only: counts the checks of every fit
        verified.append(1)
        verify(check)

    ReplicaCheck.verify = counted
    checks = []
    for options in CONFIGS:
        lit = C.LitDLRM(C.make_net("collection"), 0.2, num_samples=STEPS * world_size * C.LOCAL_BATCH)
        strategy = TwoDSparseStrategy(shard_group_size=2, sharding=SHARDING, verify_replicas=1, **options)
        before = len(verified)
        pl.Trainer(devices=world_size, strategy=strategy, **C.trainer_kwargs(STEPS)).fit(lit)
        checks.append(len(verified) - before)
    return checks


def test_no_false_alarm_on_any_wire():
    """Every wire and mode leaves identical copies: checked after every reduction, none raises."""
    results = run_distributed(_configs_worker, C.WORLD, C.free_port(), timeout=600)
    for rank, checks in enumerate(results):
        # interval 2: 2 rounds; overlapped: only the end of fit's drain; otherwise one a step; + end of fit
        assert checks == [3, STEPS + 1, 1, STEPS + 1], f"rank {rank}: checks per config {checks}"


def _fabric_worker(rank: int, world_size: int, port: int, path: str) -> str | None:
    """A Fabric loop of 2 steps, one copy nudged, then ``fabric.save``: the error it raised, or None."""
    C.as_external_rank(rank, world_size, port)
    fabric = Fabric(accelerator="cpu", devices=world_size,
                    strategy=TwoDSparseFabricStrategy(shard_group_size=2, sharding=SHARDING))
    fabric.launch()
    lit = C.LitDLRM(C.make_net("collection"), 0.2)
    model, optimizer = fabric.setup(lit, torch.optim.SGD(lit.parameters(), lr=0.2))
    dataset = C.ClickDataset(2 * world_size * C.LOCAL_BATCH)
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=False)
    for index, batch in enumerate(DataLoader(dataset, batch_size=C.LOCAL_BATCH, sampler=sampler,
                                             collate_fn=C.collate)):
        fabric.backward(model.training_step(batch, index))
        optimizer.step()
        optimizer.zero_grad()
    if rank == CORRUPT_RANK:
        nudge(owned(fabric.strategy, "state")[1])
    try:
        fabric.save(path, {"model": model, "optimizer": optimizer})
    except ReplicaMismatchError as err:
        return str(err)
    return None


def test_fabric_save_checks_first_and_writes_nothing(tmp_path):
    path = tmp_path / "ckpt"
    results = run_distributed(_fabric_worker, C.WORLD, C.free_port(), str(path), timeout=300)
    for rank, message in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert "row-wise optimizer state: ranks [3] differ from ranks [1]" in message, message
    assert not path.exists(), "no checkpoint of diverged copies is written"
