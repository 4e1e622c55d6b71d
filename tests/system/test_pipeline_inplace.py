"""Input-dist pipelining when the user edits the batch in place: bit-identical to ``pipeline=False``.

The ids of batch ``i + 1`` leave during step ``i``; if ``on_after_batch_transfer`` or
``training_step`` then changes the batch's ids or per-id weights in place (same tensors, same
``SparseFeatures`` or ``KeyedJaggedTensor`` object), the ids sent ahead are stale and must not be
used. Two gloo processes pose as externally launched ranks (``strategy_cases``' DLRM on a 1x2 mesh,
column-, row- and table-wise tables) and fit 2 epochs of 3 steps with and without pipelining, for:

* ``step``: ``training_step`` remaps the ids of a ``SparseFeatures`` batch in place;
* ``after_transfer``: ``on_after_batch_transfer`` does it;
* ``kjt``: ``training_step`` remaps the ids of a ``KeyedJaggedTensor`` batch in place;
* ``weights`` / ``kjt_weights``: ``training_step`` scales the per-id weights in place.

Losses and final weights must be equal bit for bit, and the first step whose ids were sent ahead
must find the change on every rank (then that collection is no longer pipelined).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod import SparseFeatures, TwoDSparseStrategy
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C

pytest.importorskip("torchrec", reason="the KJT cases need torchrec (requirements/torchrec.txt)")

WORLD = 2
LOCAL = 4
PER_RANK = 12  # 3 steps an epoch
EPOCHS = 2
ROWS = min(rows for _, rows, _, _ in C.TABLES)  # remapped ids stay in every table
MODES = ["step", "after_transfer", "kjt", "weights", "kjt_weights"]


def _collate(items: list[dict], kjt: bool, weighted: bool) -> dict:
    batch = C.collate(items)
    features = batch["sparse"]
    if weighted:
        weights = 1.0 + (features.values % 5).float() / 4
        features = SparseFeatures(features.keys, features.values, features.lengths, weights)
    batch["sparse"] = features.to_kjt() if kjt else features
    return batch


def _remap(features) -> None:
    """Change every id of ``features`` (SparseFeatures or KJT) in place, within ``[0, ROWS)``."""
    values = features.values() if callable(features.values) else features.values
    values.add_(1).remainder_(ROWS)


def _rescale(features) -> None:
    """Change every per-id weight of ``features`` in place."""
    weights = features.weights() if callable(features.weights) else features.weights
    weights.mul_(0.5).add_(0.25)


class InPlaceDLRM(C.LitDLRM):
    """``LitDLRM`` whose batches are edited in place as ``mode`` says (None: not edited)."""

    def __init__(self, mode: str | None) -> None:
        super().__init__(C.make_net("collection"), 0.05, batch_size=LOCAL, num_samples=PER_RANK * WORLD)
        self.mode = mode
        self.losses: list[float] = []

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.mode == "after_transfer":
            _remap(batch["sparse"])
        return batch

    def training_step(self, batch, batch_idx):
        if self.mode in ("step", "kjt"):
            _remap(batch["sparse"])
        elif self.mode in ("weights", "kjt_weights"):
            _rescale(batch["sparse"])
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        dataset = C.ClickDataset(self.num_samples)
        sampler = DistributedSampler(dataset, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        kjt, weighted = self.mode in ("kjt", "kjt_weights"), self.mode in ("weights", "kjt_weights")
        return DataLoader(dataset, batch_size=LOCAL, sampler=sampler,
                          collate_fn=lambda items: _collate(items, kjt, weighted))


class _PipelineCounts(Callback):
    """The strategy's pipeline counters ``(used, missed)``, read before the teardown closes it."""

    counts = None

    def on_train_end(self, trainer, pl_module) -> None:
        pipeline = trainer.strategy.input_pipeline
        self.counts = None if pipeline is None else (pipeline.used, pipeline.missed)


def _fit(world: int, mode: str | None, pipeline: bool) -> dict:
    lit, counts = InPlaceDLRM(mode), _PipelineCounts()
    strategy = TwoDSparseStrategy(shard_group_size=world, sharding=K.SHARDING, sparse_lr=0.05, pipeline=pipeline)
    kwargs = C.trainer_kwargs(-1)
    kwargs.update(max_epochs=EPOCHS)
    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[counts], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lit)
    return {"state": C.numpy_state(lit.net.state_dict()), "losses": lit.losses, "counts": counts.counts,
            "warnings": [str(w.message) for w in caught if "input pipelining" in str(w.message)]}


def _worker(rank: int, world: int, port: int) -> dict:
    C.as_external_rank(rank, world, port)
    out = {"unedited": _fit(world, None, False)}
    for mode in MODES:
        for pipeline in (False, True):
            out[f"{mode}/{'pipe' if pipeline else 'ref'}"] = _fit(world, mode, pipeline)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    """``{run name: [result of rank 0, result of rank 1]}``."""
    results = K.run_ranks(_worker, WORLD, C.free_port(), timeout=600)
    return {name: [r[name] for r in results] for name in results[0]}


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_edited_in_place_trains_as_without_pipelining(runs, mode):
    pipe, ref = runs[f"{mode}/pipe"], runs[f"{mode}/ref"]
    for rank, (got, want) in enumerate(zip(pipe, ref, strict=True)):
        if "weights" not in mode:  # (the weighted batches differ from the unedited ones anyway)
            assert want["losses"] != runs["unedited"][rank]["losses"], "the edit did not change the run"
        assert got["losses"] == want["losses"], f"rank {rank}: losses differ"
        assert got["state"].keys() == want["state"].keys()
        for key, value in want["state"].items():
            np.testing.assert_array_equal(got["state"][key], value, err_msg=f"rank {rank}: {key}")
        # step 0 learns where the features are; step 1 (sent ahead) finds the edit: no pipelining after
        assert got["counts"] == (0, 1), f"rank {rank}: {got['counts']}"
        assert len(got["warnings"]) == 1
        assert want["counts"] is None


