"""``SyncSchedule``: when a round of the cross-group reduction runs, when a drain owes one and which
rounds are verified; the emulator keeps its interval with it (the strategies' rounds on processes:
``tests/system/test_reduction_points.py``, ``test_verify_replicas.py``)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from torch import nn

import lightning_twod.replication.schedule as schedule_module
from lightning_twod.replication.schedule import SyncSchedule
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator


def _run(schedule: SyncSchedule, steps: int) -> list[int]:
    """The steps after which a round was due, each run at once as a runner does."""
    due = []
    for _ in range(steps):
        if schedule.step():
            due.append(schedule.steps)
            schedule.restart()
    return due


def test_a_round_is_due_every_interval_and_a_drain_restarts_it():
    schedule = SyncSchedule(interval=3, rounds=True)
    assert _run(schedule, 7) == [3, 6] and schedule.owed and schedule.pending == 1
    schedule.restart()  # a drain's round, or a checkpoint load
    assert not schedule.owed and _run(schedule, 3) == [10]


def test_without_copies_to_reduce_no_round_is_ever_due():
    schedule = SyncSchedule(interval=1, rounds=False)
    assert _run(schedule, 5) == [] and not schedule.owed and schedule.steps == 5


def test_overlap_launches_unless_told_to_wait():
    assert SyncSchedule(overlap=True).waits() is False and SyncSchedule(overlap=True).waits(True) is True
    assert SyncSchedule().waits() is True


@pytest.mark.parametrize("every, verified", [(None, []), (1, [1, 2, 3, 4, 5, 6]), (4, [4])])
def test_every_nth_completed_round_is_verified(every, verified):
    schedule = SyncSchedule(verify_every=every)
    assert [n for n in range(1, 7) if schedule.completed()] == verified


@pytest.mark.parametrize("field, value", [("interval", 0), ("verify_every", 0)])
def test_a_count_below_one_is_refused(field, value):
    with pytest.raises(ValueError, match=r">= 1"):
        SyncSchedule(**{field: value})


def test_the_schedule_imports_neither_lightning_nor_torch():
    tree = ast.parse(inspect.getsource(schedule_module))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses"}, imported


def test_the_emulator_reduces_on_the_schedule():
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(8, 2, mode="sum"), "out": nn.Linear(2, 1)})
    emulator = MeshEmulator(model, EmulatedLayout(4, 2, sync_interval=2), SparseOptimizerConfig("sgd", lr=0.1),
                            lambda m, batch: m["out"](m["emb"](batch["ids"])).sum(),
                            lambda params: torch.optim.SGD(params, 0.1))
    batches = [{"ids": torch.tensor([[rank, rank + 1]])} for rank in range(4)]
    emulator.step(batches)
    assert emulator.schedule.owed and emulator.in_flight is None
    assert not torch.equal(*emulator.copies["emb.weight"])  # each replica group stepped on its own batches
    emulator.step(batches)
    assert not emulator.schedule.owed and emulator.schedule.steps == 2
    assert torch.equal(*emulator.copies["emb.weight"])  # the second step's round made the copies one
    emulator.step(batches)
    with emulator.drained():
        assert not emulator.schedule.owed  # the drain reduced the step left over
    assert emulator.schedule.owed and emulator.schedule.pending == 1  # restored after the block
