"""Uneven data across ranks: every rank ends every loader's iteration together, never hangs, and never
pairs steps of different epochs.

Two gloo processes pose as torchrun ranks (``strategy_cases.as_external_rank``; the process group
times out after 60 s, so a regression fails instead of hanging) and run, with ``strategy_cases``'
DLRM on a 1x2 mesh:

* 2 epochs of ``fit``, pipelined and not, on ``IterableDataset`` loaders (no length) in which rank 1
  has one batch more than rank 0, for training (4 vs 3) and validation (3 vs 2): every rank runs 3
  training steps and 2 validation batches an epoch, at the same epochs and batch indices; rank 1's
  extra batches are never trained or validated; rank 0 warns once per loop end, naming each rank's
  count; the pipelined run is bit-identical to the unpipelined one;
* pipelined ``fit`` on sized loaders of different lengths (4 batches on rank 1, 3 on rank 0; Lightning's
  sampler off): both ranks see a length of 3 (progress bar, ``num_training_batches``), one warning
  at set-up;
* ``predict`` on both kinds: one clear ``RuntimeError`` on every rank (a skipped batch would be
  missing predictions);
* a Fabric loop over the uneven stream: both ranks iterate 3 batches, rank 0 warns;
* below Lightning, an iterable that is not a ``DataLoader``: wrapped, in step, its attributes readable.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.utilities.data import sized_len
from torch.utils.data import DataLoader, IterableDataset

from lightning_twod import TwoDSparseFabricStrategy, TwoDSparseStrategy
from lightning_twod.strategies.even_batches import even_batches
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.timeout(600)

WORLD = 2
EPOCHS = 2
TRAIN_BATCHES = {0: 3, 1: 4}
VAL_BATCHES = {0: 2, 1: 3}


class _Stream(IterableDataset):
    """``batches * LOCAL_BATCH`` samples of this rank: ``rank, rank + W, ...`` (no length)."""

    def __init__(self, rank: int, batches: int, seed: int = 0) -> None:
        self.rank, self.batches, self.dataset = rank, batches, C.ClickDataset(10**4, seed=seed)

    def __iter__(self):
        return (self.dataset[self.rank + WORLD * i] for i in range(self.batches * C.LOCAL_BATCH))


def _stream(rank: int, batches: dict[int, int], seed: int = 0) -> DataLoader:
    return DataLoader(_Stream(rank, batches[rank], seed), batch_size=C.LOCAL_BATCH, collate_fn=C.collate)


def _sized(rank: int, batches: dict[int, int]) -> DataLoader:
    """A map-style loader with ``batches[rank]`` batches on this rank (the sampler is a list)."""
    indices = [rank + WORLD * i for i in range(batches[rank] * C.LOCAL_BATCH)]
    return DataLoader(C.ClickDataset(10**4), batch_size=C.LOCAL_BATCH, sampler=indices, collate_fn=C.collate)


class UnevenDLRM(C.LitDLRM):
    """``LitDLRM`` on the uneven loaders; records ``(epoch, batch_idx, sample ids)`` of every step."""

    def __init__(self, sized: bool = False) -> None:
        super().__init__(C.make_net("collection"), 0.05)
        self.sized = sized
        self.steps: list[tuple[int, int, list[int]]] = []
        self.val_steps: list[tuple[int, int, list[int]]] = []
        self.lengths: tuple = ()
        self.sent_ahead: int | None = None  # lookups that took ids sent ahead (pipelined)

    def training_step(self, batch, batch_idx):
        self.steps.append((self.current_epoch, batch_idx, batch["idx"].tolist()))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.val_steps.append((self.current_epoch, batch_idx, batch["idx"].tolist()))

    def predict_step(self, batch, batch_idx):
        return self.net(batch)

    def on_train_start(self):
        self.lengths = (sized_len(self.trainer.train_dataloader), self.trainer.num_training_batches)

    def on_train_end(self):
        pipeline = self.trainer.strategy.input_pipeline
        self.sent_ahead = None if pipeline is None else pipeline.used

    def train_dataloader(self):
        return (_sized if self.sized else _stream)(self.global_rank, TRAIN_BATCHES)

    def val_dataloader(self):
        return _stream(self.global_rank, VAL_BATCHES, seed=1)


def _strategy(pipeline: bool = False) -> TwoDSparseStrategy:
    return TwoDSparseStrategy(shard_group_size=2, sparse_lr=0.05, pipeline=pipeline, timeout=60)


def _caught(fn) -> tuple[object, list[str]]:
    """``fn()``'s result (or the text of the ``RuntimeError`` it raised) and the uneven-data warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except RuntimeError as err:
            result = f"RuntimeError: {err}"
    return result, [str(w.message) for w in caught if "uneven data" in str(w.message)]


def _fit(pipeline: bool, sized: bool = False) -> dict:
    lit = UnevenDLRM(sized)
    kwargs = C.trainer_kwargs(-1, max_epochs=EPOCHS, use_distributed_sampler=not sized)
    trainer = pl.Trainer(devices=WORLD, strategy=_strategy(pipeline), **kwargs)
    _, caught = _caught(lambda: trainer.fit(lit))
    return {"steps": lit.steps, "val_steps": lit.val_steps, "lengths": lit.lengths, "warnings": caught,
            "sent_ahead": lit.sent_ahead,
            "state": C.numpy_state(lit.net.state_dict())}


def _predict(rank: int, sized: bool) -> tuple[object, list[str]]:
    trainer = pl.Trainer(devices=WORLD, strategy=_strategy(), use_distributed_sampler=False,
                         **C.trainer_kwargs(-1))
    loader = (_sized if sized else _stream)(rank, TRAIN_BATCHES)
    return _caught(lambda: trainer.predict(UnevenDLRM(), loader))


def _fabric(rank: int) -> tuple[object, list[str]]:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=TwoDSparseFabricStrategy(shard_group_size=2))
    fabric.launch()
    lit = C.LitDLRM(C.make_net("collection"), 0.05)
    model, optimizer = fabric.setup(lit, lit.configure_optimizers())
    loader = fabric.setup_dataloaders(_stream(rank, TRAIN_BATCHES))

    def loop() -> list[list[int]]:
        seen = []
        for index, batch in enumerate(loader):
            seen.append(batch["idx"].tolist())
            fabric.backward(model.training_step(batch, index))
            optimizer.step()
            optimizer.zero_grad()
        return seen

    return _caught(loop)


def _worker(rank: int, world: int, port: int) -> dict:
    C.as_external_rank(rank, world, port)
    return {"ref": _fit(pipeline=False), "pipe": _fit(pipeline=True), "sized": _fit(pipeline=True, sized=True),
            "predict stream": _predict(rank, sized=False), "predict sized": _predict(rank, sized=True),
            "fabric": _fabric(rank)}


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    """``{run name: [result of rank 0, result of rank 1]}``."""
    results = run_distributed(_worker, WORLD, C.free_port(), timeout=540)
    return {name: [r[name] for r in results] for name in results[0]}


def _batch_ids(rank: int, batch: int) -> list[int]:
    """The sample ids of batch ``batch`` of ``rank``'s stream."""
    return [rank + WORLD * (batch * C.LOCAL_BATCH + i) for i in range(C.LOCAL_BATCH)]


@pytest.mark.parametrize("run", ["ref", "pipe"])
def test_every_rank_ends_each_epoch_together_and_skips_the_extra_batch(runs, run):
    ranks = runs[run]
    for rank, result in enumerate(ranks):
        # the same epochs and batch indices on every rank: no step pairs two epochs
        assert [s[:2] for s in result["steps"]] == [(e, b) for e in range(EPOCHS) for b in range(3)], rank
        assert [s[2] for s in result["steps"]] == [_batch_ids(rank, b) for _ in range(EPOCHS)
                                                   for b in range(3)], rank  # rank 1's 4th batch never trains
        assert [s[:2] for s in result["val_steps"]] == [(e, b) for e in range(EPOCHS) for b in range(2)], rank
    train = "the train dataloader ran out of batches: rank 0: 3, rank 1: at least 4"
    val = "the val dataloader ran out of batches: rank 0: 2, rank 1: at least 3"
    assert [w.split(";")[0] for w in ranks[0]["warnings"]] == [f"uneven data: {m}" for m in [train, val] * EPOCHS]
    assert ranks[1]["warnings"] == []


def test_pipelined_run_equals_the_unpipelined_one(runs):
    # each epoch's batches 2 and 3 took ids sent ahead; nothing was sent past an epoch's agreed end
    assert [r["sent_ahead"] for r in runs["pipe"]] == [EPOCHS * 2] * WORLD
    for pipe, ref in zip(runs["pipe"], runs["ref"], strict=True):
        assert pipe["steps"] == ref["steps"]
        for key, value in ref["state"].items():
            np.testing.assert_array_equal(pipe["state"][key], value, err_msg=key)


def test_sized_loaders_of_different_lengths_take_the_shortest_on_every_rank(runs):
    ranks = runs["sized"]
    for rank, result in enumerate(ranks):
        assert result["lengths"] == (3, 3), rank
        assert result["sent_ahead"] == EPOCHS * 2, rank  # pipelined: the next batch is read ahead
        assert [s[:2] for s in result["steps"]] == [(e, b) for e in range(EPOCHS) for b in range(3)], rank
    train = [w.split(";")[0] for w in ranks[0]["warnings"] if "train dataloader" in w]  # once, at set-up
    assert train == [
        "uneven data: the train dataloader has a different number of batches on each rank: rank 0: 3, rank 1: 4"]
    assert ranks[1]["warnings"] == []


@pytest.mark.parametrize("kind", ["stream", "sized"])
def test_uneven_predict_raises_on_every_rank(runs, kind):
    (error0, _), (error1, _) = runs[f"predict {kind}"]
    assert error0 == error1
    assert error0.startswith("RuntimeError: uneven data: the predict dataloader")
    assert "rank 0: 3, rank 1: " in error0 and "EvalShardSampler" in error0


def test_fabric_loop_ends_together(runs):
    (seen0, warned0), (seen1, warned1) = runs["fabric"]
    assert seen0 == [_batch_ids(0, b) for b in range(3)]
    assert seen1 == [_batch_ids(1, b) for b in range(3)]
    assert [w.split(";")[0] for w in warned0] == [
        "uneven data: the dataloader ran out of batches: rank 0: 3, rank 1: at least 4"]
    assert warned1 == []


class _Numbers:
    """An iterable that is not a ``DataLoader`` (Lightning takes any iterable): ``count`` numbers."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        return iter(range(self.count))


def _iterable_worker(rank: int, world: int) -> dict:
    even = even_batches(_Numbers(2 + rank), dist.group.WORLD, "numbers")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [list(even), list(even)]
    return {"epochs": epochs, "count": even.count, "sized": sized_len(even),
            "warnings": [str(w.message).split(";")[0] for w in caught]}


def test_another_iterable_is_wrapped_and_keeps_its_attributes():
    ranks = run_distributed(_iterable_worker, WORLD, timeout=120)
    assert [r["epochs"] for r in ranks] == [[[0, 1], [0, 1]]] * WORLD
    assert [r["count"] for r in ranks] == [2, 3] and [r["sized"] for r in ranks] == [None, None]
    assert ranks[0]["warnings"] == ["uneven data: the numbers ran out of batches: rank 0: 2, rank 1: at least 3"] * 2
    assert ranks[1]["warnings"] == []


class _Counted:
    """An iterable that counts the items read from it; ``stateful``: it has ``state_dict``/``load_state_dict``
    (as a loader whose checkpoints keep its place)."""

    def __init__(self, stateful: bool) -> None:
        self.reads = 0
        if stateful:
            self.state_dict, self.load_state_dict = (lambda: {"reads": self.reads}), (lambda state: None)

    def __iter__(self):
        for item in range(5):
            self.reads += 1
            yield item


def _ahead_worker(rank: int, world: int) -> dict:
    out = {}
    for stateful in (False, True):
        counted = _Counted(stateful)
        iterator = iter(even_batches(counted, dist.group.WORLD, "counted"))
        out[stateful] = [(next(iterator), counted.reads) for _ in range(3)]
    return out


def test_each_batchs_agreement_is_started_one_batch_ahead_unless_the_loader_checkpoints_its_place():
    """A batch is read, and its all-reduce started, as the batch before is handed out: the agreement
    travels while that batch's step runs. A loader with a ``state_dict`` is read only when asked: its
    saved place would otherwise count a batch not yet trained on."""
    for ranks in run_distributed(_ahead_worker, WORLD, timeout=120):
        assert ranks[False] == [(0, 2), (1, 3), (2, 4)]
        assert ranks[True] == [(0, 1), (1, 2), (2, 3)]
