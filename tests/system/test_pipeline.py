"""Input-dist pipelining (``TwoDSparseStrategy(pipeline=True)``): bit-identical to ``pipeline=False``.

Four gloo processes (``run_ranks``) pose as externally launched ranks and run Trainers one after
another, on 2x2 and 1x4 meshes, with ``strategy_cases``' DLRM (column-, row- and table-wise tables,
FBGEMM kernels where available). Each rank has 10 samples an epoch in batches of 4: the last batch of
an epoch is smaller and has nothing after it to prefetch; validation runs every 2 steps in between.
Per mesh, every pair is compared exactly (losses, validation losses, final weights):

* 2 epochs pipelined vs unpipelined; both save a checkpoint in the middle of epoch 2;
* each resumed from its checkpoint;
* 2x2: rank 1 hands its collection a changed copy of one batch's features: every rank falls back for
  that step (and stops pipelining that collection), as the unpipelined run computes;
* 1x4: a loader without length (Lightning's fetcher holds the next batch itself); a loader that keeps
  its own state in checkpoints (never read ahead: not pipelined); and a batch with an id out of range
  on rank 1: the same ``ValueError`` on every rank, pipelined or not.

Below the Trainer, ``InputPipeline`` drives both collections (pooled and sequence, every sharding
type, per-id weights) on 2x2 and 1x4 directly: a bad batch sent ahead raises on every rank, and a
next batch in which rank 1 has no features at all makes every rank send again, with no rank left
waiting; outputs and weights equal the unpipelined twin's exactly.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_twod import SparseFeatures, TwoDSparseStrategy
from lightning_twod.core.shards import place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.pipeline import InputPipeline
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed
from tests.helpers.sparse_cases import POOLED_TABLES, constraints, make_module, random_batch

LOCAL = 4
PER_RANK = 10  # batches of 4, 4, 2
NUM_SAMPLES = PER_RANK * C.WORLD
EPOCHS = 2
SAVE_AT = 4  # global step of the mid-training checkpoint: the middle of epoch 2
BAD_STEP = 2  # the batch with an id out of range (rank 1)
CHANGED_STEP = 1  # the step at which rank 1 changes its features (2x2)


class _Stream(IterableDataset):
    """This rank's samples ``r, r + W, ...`` without a length (Lightning then prefetches itself)."""

    def __init__(self, dataset, rank: int, world: int) -> None:
        self.dataset, self.rank, self.world = dataset, rank, world

    def __iter__(self):
        return (self.dataset[i] for i in range(self.rank, len(self.dataset), self.world))


class _BadSample(torch.utils.data.Dataset):
    """``ClickDataset`` whose sample ``index`` reads row 10**6 of ``t_user``."""

    def __init__(self, dataset, index: int) -> None:
        self.dataset, self.index = dataset, index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        item = self.dataset[i]
        return {**item, "user": [10**6] * len(item["user"])} if i == self.index else item


class _StatefulLoader(DataLoader):
    """A loader that keeps its own state in checkpoints (as torchdata's ``StatefulDataLoader``)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class PipeDLRM(C.LitDLRM):
    """``LitDLRM`` recording losses, with validation, and the variants above."""

    def __init__(self, stream: bool = False, change_at: int | None = None, bad: bool = False,
                 stateful: bool = False) -> None:
        super().__init__(C.make_net("collection"), 0.05, batch_size=LOCAL, num_samples=NUM_SAMPLES)
        self.stream, self.change_at, self.bad, self.stateful = stream, change_at, bad, stateful
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.global_step == self.change_at and self.global_rank == 1:
            features = batch["sparse"]
            values = features.values.clone()
            values[0] = (values[0] + 1) % C.FEATURE_TABLE[features.keys[0]][1]
            batch = {**batch, "sparse": SparseFeatures(features.keys, values, features.lengths)}
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self.net.loss(batch).item())

    def train_dataloader(self):
        dataset = C.ClickDataset(NUM_SAMPLES)
        world, rank = self.trainer.world_size, self.trainer.global_rank
        if self.stream:
            return DataLoader(_Stream(dataset, rank, world), batch_size=LOCAL, collate_fn=C.collate)
        if self.bad:  # step BAD_STEP of rank 1 holds sample rank + world * LOCAL * BAD_STEP
            dataset = _BadSample(dataset, 1 + world * LOCAL * BAD_STEP)
        sampler = DistributedSampler(dataset, world, rank, shuffle=False)
        loader = _StatefulLoader if self.stateful else DataLoader
        return loader(dataset, batch_size=LOCAL, sampler=sampler, collate_fn=C.collate)

    def val_dataloader(self):
        dataset = C.ClickDataset(8 * self.trainer.world_size, seed=1)
        sampler = DistributedSampler(dataset, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=LOCAL, sampler=sampler, collate_fn=C.collate)


class _SaveAt(Callback):
    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class _PipelineCounts(Callback):
    """The strategy's pipeline counters, read before the teardown closes it."""

    def __init__(self) -> None:
        self.counts = None

    def on_train_end(self, trainer, pl_module) -> None:
        pipeline = trainer.strategy.input_pipeline
        self.counts = None if pipeline is None else (pipeline.used, pipeline.missed)


def _fit(world: int, group: int, pipeline: bool, ckpt_path=None, save=None, **module) -> dict:
    lit = PipeDLRM(**module)
    counts = _PipelineCounts()
    callbacks = [counts] + ([_SaveAt(save, SAVE_AT)] if save else [])
    strategy = TwoDSparseStrategy(shard_group_size=group, sharding=K.SHARDING, sparse_lr=0.05, pipeline=pipeline)
    kwargs = C.trainer_kwargs(-1)
    kwargs.update(max_epochs=EPOCHS, val_check_interval=2)
    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=callbacks, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lit, ckpt_path=ckpt_path)
    return {"state": C.numpy_state(lit.net.state_dict()), "losses": lit.losses, "val_losses": lit.val_losses,
            "seen": lit.seen, "counts": counts.counts, "global_step": trainer.global_step,
            "warnings": [str(w.message) for w in caught if "input pipelining" in str(w.message)]}


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    out = {}
    for group, name in ((2, "2x2"), (4, "1x4")):
        for pipeline in (False, True):
            tag = f"{name}/{'pipe' if pipeline else 'ref'}"
            out[tag] = _fit(world, group, pipeline, save=f"{root}/{tag.replace('/', '_')}")
            out[f"{tag}/resumed"] = _fit(world, group, pipeline, ckpt_path=f"{root}/{tag.replace('/', '_')}")
    for pipeline in (False, True):
        tag = "pipe" if pipeline else "ref"
        out[f"2x2/changed/{tag}"] = _fit(world, 2, pipeline, change_at=CHANGED_STEP)
        out[f"1x4/bad/{tag}"] = _error_of(lambda pipeline=pipeline: _fit(world, 4, pipeline, bad=True))
    out["1x4/stream/pipe"] = _fit(world, 4, True, stream=True)
    out["1x4/stateful/pipe"] = _fit(world, 4, True, stateful=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list]:
    """``{run name: [result of rank 0, ..., rank 3]}``."""
    root = tmp_path_factory.mktemp("pipeline")
    results = K.run_ranks(_worker, C.WORLD, C.free_port(), str(root), timeout=600)
    return {name: [r[name] for r in results] for name in results[0]}


def _assert_same_training(got: list[dict], want: list[dict]) -> None:
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["global_step"] == w["global_step"]
        assert g["seen"] == w["seen"], f"rank {rank}: other samples"
        assert g["losses"] == w["losses"], f"rank {rank}: losses differ"
        assert g["val_losses"] == w["val_losses"], f"rank {rank}: validation losses differ"
        assert g["state"].keys() == w["state"].keys()
        for key, value in w["state"].items():
            np.testing.assert_array_equal(g["state"][key], value, err_msg=f"rank {rank}: {key}")


@pytest.mark.parametrize("mesh", ["2x2", "1x4"])
def test_pipelined_fit_is_bit_identical_with_validation_and_a_short_last_batch(runs, mesh):
    pipe, ref = runs[f"{mesh}/pipe"], runs[f"{mesh}/ref"]
    _assert_same_training(pipe, ref)
    steps_per_epoch = 3
    assert ref[0]["global_step"] == EPOCHS * steps_per_epoch and len(ref[0]["seen"][-1]) == 2  # short last batch
    assert len(ref[0]["val_losses"]) > 0
    assert ref[0]["counts"] is None  # pipeline=False: no pipeline
    # per epoch: the first batch's ids go in its forward (the first step of all also learns where
    # the features are); each later one was sent ahead; nothing is prefetched past an epoch's end
    assert [r["counts"] for r in pipe] == [(EPOCHS * (steps_per_epoch - 1), 0)] * C.WORLD
    assert pipe[0]["warnings"] == []


@pytest.mark.parametrize("mesh", ["2x2", "1x4"])
def test_pipelined_resume_from_a_mid_epoch_checkpoint_matches_the_unpipelined_one(runs, mesh):
    pipe, ref = runs[f"{mesh}/pipe/resumed"], runs[f"{mesh}/ref/resumed"]
    _assert_same_training(pipe, ref)
    assert ref[0]["global_step"] == EPOCHS * 3
    assert pipe[0]["counts"][0] > 0 and pipe[0]["counts"][1] == 0


def test_changed_features_on_one_rank_fall_back_on_every_rank(runs):
    pipe, ref = runs["2x2/changed/pipe"], runs["2x2/changed/ref"]
    _assert_same_training(pipe, ref)
    assert ref[0]["losses"] != runs["2x2/ref"][0]["losses"]  # the change did change the run
    # step 1 missed; the collection is no longer pipelined afterwards
    assert [r["counts"] for r in pipe] == [(0, 1)] * C.WORLD
    assert all(len(r["warnings"]) == 1 for r in pipe)


def test_bad_batch_raises_the_same_error_pipelined_or_not(runs):
    pipe, ref = runs["1x4/bad/pipe"], runs["1x4/bad/ref"]
    assert pipe == ref
    assert all(m is not None and "rank 1" in m and "10000" in m for m in pipe), pipe[0]


def test_loader_without_length_is_pipelined_from_lightnings_own_prefetch(runs):
    pipe, ref = runs["1x4/stream/pipe"], runs["1x4/ref"]
    _assert_same_training(pipe, ref)
    assert [r["counts"] for r in pipe] == [(EPOCHS * 2, 0)] * C.WORLD


def test_a_loader_with_its_own_state_is_not_read_ahead(runs):
    pipe, ref = runs["1x4/stateful/pipe"], runs["1x4/ref"]
    _assert_same_training(pipe, ref)
    assert [r["counts"] for r in pipe] == [(0, 0)] * C.WORLD


# ----------------------------------------------------------------------------- the pipeline alone
MODULE_STEPS = 6
BAD_AT = 2  # rank 1's batch of this step has an id out of range: it is sent ahead, and rejected
ABSENT_AT = 3  # the next batch rank 1 hands the pipeline for this step holds no features


def _module_run(sharded, batches: list[SparseFeatures], pipeline: InputPipeline | None, rank: int) -> dict:
    outputs, errors = [], []
    for t, features in enumerate(batches):
        batch = {"sparse": features}
        if pipeline is not None:
            pipeline.begin_step(batch, t)
        try:
            out = sharded(features)
        except ValueError as err:
            errors.append((t, str(err)))
        else:
            values = [out[f].values for f in sorted(out)] if isinstance(out, dict) else [out.values()]
            sum(v.pow(2).sum() for v in values).backward()
            for kernel in sharded.kernels():
                kernel.step()
            outputs.append([v.detach().numpy().copy() for v in values])  # plain arrays: they outlive the rank
        if pipeline is not None:
            ahead = {"sparse": batches[t + 1]} if t + 1 < len(batches) else None
            if t + 1 == ABSENT_AT and rank == 1:
                ahead = {"nothing": "here"}
            pipeline.end_step(ahead, t + 1)
    return {"outputs": outputs, "errors": errors,
            "weights": [w.detach().numpy().copy() for _, w in sharded.local_shards()]}


def _module_worker(rank: int, world: int, group_size: int) -> dict:
    groups = MeshGroups.create(SparseParallelDims(world, group_size))
    side = groups.duplicate()
    plan = place_tables([(n, r, d) for n, r, d, *_ in POOLED_TABLES], group_size, constraints())
    batches = [random_batch(3 * world, seed=40 + t).split_batch([3] * world)[rank] for t in range(MODULE_STEPS)]
    if rank == 1:
        bad = batches[BAD_AT]
        values = bad.values.clone()
        values[0] = 10**6
        batches[BAD_AT] = SparseFeatures(bad.keys, values, bad.lengths, bad.weights)
    out = {}
    for pooled in (True, False):
        runs = {}
        for pipelined in (False, True):
            sharded = shard_collection(make_module(pooled, seed=3), ShardingSpec(groups, backend="torch",
                                                                                 optimizer=SparseOptimizerConfig("sgd",
                                                                                                                 lr=0.5)),
                                       plan=plan)
            pipeline = InputPipeline({"sparse": sharded}, {side.dims.shard_group_size: side}, "cpu") if pipelined else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the warning of the miss
                runs[pipelined] = _module_run(sharded, batches, pipeline, rank)
            if pipeline is not None:
                runs[pipelined]["counts"] = (pipeline.used, pipeline.missed)
                pipeline.close()
        out[pooled] = runs
    return out


@pytest.mark.parametrize("group_size", [2, 4], ids=["2x2", "1x4"])
def test_pipeline_alone_rejects_bad_input_and_survives_a_rank_without_features(group_size):
    for rank, result in enumerate(run_distributed(_module_worker, C.WORLD, group_size, timeout=120)):
        for pooled, runs in result.items():
            ref, pipe = runs[False], runs[True]
            assert pipe["errors"] == ref["errors"] and [t for t, _ in ref["errors"]] == [BAD_AT]
            assert "rank 1" in ref["errors"][0][1]
            assert len(pipe["outputs"]) == len(ref["outputs"]) == MODULE_STEPS - 1
            for got, want in zip(pipe["outputs"], ref["outputs"], strict=True):
                assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), (rank, pooled)
            assert all(np.array_equal(g, w) for g, w in zip(pipe["weights"], ref["weights"], strict=True))
            # step 0 learns; steps 1 and 2 (the bad one) take ids sent ahead; step 3 misses: no more after
            assert pipe["counts"] == (2, 1), (rank, pooled, pipe["counts"])


