"""Validation and checkpoints see identical copies: they complete the reduction of an unfinished
interval first, and the interval restarts there.

A 2x2 fit with ``sync_interval=3`` over 9 steps, validation after steps 4 and 8, and a
``ModelCheckpoint`` after step 5. Reductions are due after steps 3 (interval), 4 (validation),
5 (checkpoint), 8 (three steps after the checkpoint; validation then finds nothing to do) and 9
(end of fit). Without the drains they would come after 3, 6 and 9 only: validation would score a
mix of diverged copies and the checkpoint would hold replica 0's rows.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod import TwoDSparseStrategy, consolidate
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

STEPS = 9
INTERVAL = 3


class ValidatedDLRM(C.LitDLRM):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net.loss(batch), batch_size=len(batch["y"]), sync_dist=True)

    def val_dataloader(self):
        dataset = C.ClickDataset(32, seed=1)
        sampler = DistributedSampler(dataset, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=C.LOCAL_BATCH, sampler=sampler, collate_fn=C.collate)


class CountedReductions(TwoDSparseStrategy):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reduced_after: list[int] = []

    def reduce_replicas(self, wait=None) -> int:
        self.reduced_after.append(self.schedule.steps)
        return super().reduce_replicas(wait)


class Watch(Callback):
    """Whether the copies agree during each validation, and at the start of each training step."""

    def __init__(self) -> None:
        self.validation: list[tuple[int, bool]] = []
        self.train_start: dict[int, bool] = {}
        self.state_at: dict[int, dict] = {}

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.validation.append((trainer.global_step, all(C.replicas_identical(trainer.strategy))))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.train_start[trainer.global_step] = all(C.replicas_identical(trainer.strategy))
        if trainer.global_step == 5:  # right after the checkpoint of step 5
            self.state_at[5] = C.numpy_state(pl_module.state_dict())


def _worker(rank: int, world_size: int, port: int, directory: str) -> dict:
    C.as_external_rank(rank, world_size, port)
    lit = ValidatedDLRM(C.make_net("collection"), 0.2, num_samples=STEPS * world_size * C.LOCAL_BATCH)
    strategy = CountedReductions(shard_group_size=2, sync_interval=INTERVAL, sparse_optimizer="rowwise_adagrad")
    watch = Watch()
    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=5, save_top_k=-1)
    kwargs = C.trainer_kwargs(STEPS)
    kwargs.update(enable_checkpointing=True, val_check_interval=4, limit_val_batches=2)
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=[watch, saver], **kwargs)
    trainer.fit(lit)
    return dict(reduced_after=strategy.reduced_after, validation=watch.validation, train_start=watch.train_start,
                state_at=watch.state_at, final=all(C.replicas_identical(strategy)))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict], Path]:
    directory = tmp_path_factory.mktemp("checkpoints")
    return run_distributed(_worker, C.WORLD, C.free_port(), str(directory), timeout=300), directory


def test_validation_and_checkpoints_complete_a_reduction_and_restart_the_interval(run):
    results, _ = run
    for rank, result in enumerate(results):
        assert result["reduced_after"] == [3, 4, 5, 8, 9], f"rank {rank}: {result['reduced_after']}"
        assert result["final"]


def test_validation_scores_identical_copies(run):
    results, _ = run
    for rank, result in enumerate(results):
        steps = sorted({step for step, _ in result["validation"]})
        assert steps == [4, 8], f"rank {rank}: validation ran after steps {steps}"
        assert all(same for _, same in result["validation"]), f"rank {rank}: {result['validation']}"
        # between reductions the copies do differ: the check above can fail
        assert result["train_start"][2] is False and result["train_start"][7] is False, result["train_start"]


def test_a_checkpoint_holds_the_rows_every_copy_agrees_on(run):
    results, directory = run
    saved = sorted(p.name for p in directory.iterdir())
    assert saved == ["epoch=0-step=5.ckpt"], saved
    assert all(r["train_start"][5] for r in results), "the copies agree right after the save"
    tables = consolidate(directory / saved[0])
    agreed = results[0]["state_at"][5]
    for name in C.embedding_names(C.make_net("collection")):
        key = f"net.{name}"  # the LightningModule's keys
        torch.testing.assert_close(tables[key], torch.as_tensor(agreed[key]), atol=0, rtol=0, msg=key)
