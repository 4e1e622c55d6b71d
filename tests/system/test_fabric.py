"""``TwoDSparseFabricStrategy``: a hand-written Fabric loop equals the Trainer path, checkpoints go
both ways on any mesh, bad batches raise on every rank, and Fabric launches spawned processes.

The multi-process checks run in ``run_distributed`` children that pose as torchrun ranks
(``strategy_cases.as_external_rank``): Fabric then reuses their process group, as the Trainer does.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod import SparseFeatures, TwoDSparseFabricStrategy, TwoDSparseStrategy
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

STEPS = 8
LR = 0.2
OPTIONS = dict(sharding={"t_item": "row_wise", "t_cat": "data_parallel"}, sparse_optimizer="rowwise_adagrad",
               sparse_lr=0.05, sync_interval=2)


class MomentumDLRM(C.LitDLRM):
    """SGD with momentum on the dense part: a stateful optimizer for the checkpoint checks."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _loader(world_size: int, rank: int, steps: int) -> DataLoader:
    dataset = C.ClickDataset(steps * world_size * C.LOCAL_BATCH)
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=False)
    return DataLoader(dataset, batch_size=C.LOCAL_BATCH, sampler=sampler, collate_fn=C.collate)


def fabric_fit(world_size: int, rank: int, group: int, steps: int, load: str | None = None,
               save: str | None = None, skip: int = 0):
    """The Fabric loop: ``steps`` steps (after ``skip`` batches, for a resumed run); returns the module."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=TwoDSparseFabricStrategy(
        shard_group_size=group, **OPTIONS))
    fabric.launch()
    lit = MomentumDLRM(C.make_net("collection"), LR)
    optimizer = lit.configure_optimizers()  # built before the set-up: it must lose the tables
    model, optimizer = fabric.setup(lit, optimizer)
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer}, strict=False)
    for index, batch in enumerate(_loader(world_size, rank, skip + steps)):
        if index < skip:
            continue
        loss = model.training_step(batch, index)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer, "step": skip + steps})
    return lit, fabric


def trainer_fit(world_size: int, group: int, steps: int, ckpt_path: str | None = None, save: str | None = None):
    lit = MomentumDLRM(C.make_net("collection"), LR, num_samples=steps * world_size * C.LOCAL_BATCH)
    strategy = TwoDSparseStrategy(shard_group_size=group, **OPTIONS)
    trainer = pl.Trainer(devices=world_size, strategy=strategy, **C.trainer_kwargs(steps))
    trainer.fit(lit, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return lit


def _worker(rank: int, world_size: int, port: int, directory: str) -> dict:
    C.as_external_rank(rank, world_size, port)
    out = {}
    for mesh, group in (("2x2", 2), ("1x4", 4)):
        out[f"trainer {mesh}"] = C.numpy_state(trainer_fit(world_size, group, STEPS).state_dict())
        lit, _ = fabric_fit(world_size, rank, group, STEPS)
        out[f"fabric {mesh}"] = C.numpy_state(lit.state_dict())
    # checkpoints both ways, on other meshes: each is loaded and saved again by the other path
    half = STEPS // 2
    fabric_fit(world_size, rank, 2, half, save=f"{directory}/fabric_2x2")
    trainer_fit(world_size, 4, 0, ckpt_path=f"{directory}/fabric_2x2", save=f"{directory}/trainer_from_fabric")
    trainer_fit(world_size, 2, half, save=f"{directory}/trainer_2x2")
    fabric_fit(world_size, rank, 4, 0, load=f"{directory}/trainer_2x2", save=f"{directory}/fabric_from_trainer")
    # a resumed Fabric loop continues as the uninterrupted one
    lit, _ = fabric_fit(world_size, rank, 2, half, load=f"{directory}/fabric_2x2", skip=half)
    out["fabric resumed"] = C.numpy_state(lit.state_dict())
    lit, _ = fabric_fit(world_size, rank, 2, STEPS)
    out["fabric uninterrupted"] = C.numpy_state(lit.state_dict())
    # a bad batch on one rank: the same ValueError everywhere, before any row changes
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=TwoDSparseFabricStrategy(shard_group_size=2))
    fabric.launch()
    lit = MomentumDLRM(C.make_net("collection"), LR)
    model, optimizer = fabric.setup(lit, lit.configure_optimizers())
    batch = next(iter(_loader(world_size, rank, 1)))
    if rank == 3:
        sparse = batch["sparse"]
        values = sparse.values.clone()
        values[0] = 10_000  # outside t_user's rows
        batch["sparse"] = SparseFeatures(sparse.keys, values, sparse.lengths)
    before = C.numpy_state(lit.state_dict())
    try:
        model.training_step(batch, 0)
        out["bad batch"] = None
    except ValueError as err:
        out["bad batch"] = str(err)
    out["unchanged"] = all((before[k] == v).all() for k, v in C.numpy_state(lit.state_dict()).items())
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict], Path]:
    directory = tmp_path_factory.mktemp("fabric")
    return run_distributed(_worker, C.WORLD, C.free_port(), str(directory), timeout=420), directory


def _close(got: dict, want: dict, tolerance: float) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(value), atol=tolerance, rtol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("mesh", ["2x2", "1x4"])
def test_the_fabric_loop_equals_the_trainer_path(run, mesh):
    results, _ = run
    _close(results[0][f"fabric {mesh}"], results[0][f"trainer {mesh}"], 1e-6)
    initial = C.make_net("collection").state_dict()
    moved = max((torch.as_tensor(results[0][f"fabric {mesh}"][f"net.{k}"]) - initial[k]).abs().max().item()
                for k in C.embedding_names(C.make_net("collection")))
    assert moved > 1e-2, "the tables trained"


def test_checkpoints_load_in_the_other_path_on_another_mesh(run):
    _, directory = run
    for source, copy in (("fabric_2x2", "trainer_from_fabric"), ("trainer_2x2", "fabric_from_trainer")):
        saved, again = K.read_checkpoint(directory / source), K.read_checkpoint(directory / copy)
        tensors = [k for k in saved if k.startswith(("state_dict.", "sparse_optimizer.", "optimizer_0."))]
        assert any(k.startswith("optimizer_0.") for k in tensors), "the dense optimizer's state is saved"
        assert any(k.startswith("sparse_optimizer.") for k in tensors), "the row-wise AdaGrad state is saved"
        for key in tensors:
            torch.testing.assert_close(again[key], saved[key], atol=0, rtol=0, msg=f"{source} -> {copy}: {key}")


def test_a_resumed_fabric_loop_continues_as_the_uninterrupted_one(run):
    results, _ = run
    _close(results[0]["fabric resumed"], results[0]["fabric uninterrupted"], 1e-6)


def test_a_bad_batch_raises_on_every_rank_before_any_row_changes(run):
    results, _ = run
    messages = [r["bad batch"] for r in results]
    assert all(m is not None and "rank 3" in m and "t_user" in m for m in messages), messages
    assert len(set(messages)) == 1
    assert all(r["unchanged"] for r in results)


# ----------------------------------------------------------------------------- drained state
EPOCH = 3  # steps per epoch: with sync_interval=2 every epoch ends mid-interval
DRAIN_CASES = {"interval 2": {}, "overlap": {"sync_overlap": True},
               "overlap bf16": {"sync_overlap": True, "sync_dtype": "bf16"},
               "overlap int8": {"sync_overlap": True, "sync_dtype": "int8"}}


def _trainer_epochs(world_size: int, epochs: int, options: dict, ckpt_path: str | None = None,
                    save: str | None = None) -> dict:
    """The Trainer on ``_loader``'s batches of ``EPOCH`` steps for ``epochs`` epochs (resumed from ``ckpt_path``);
    saves at the end of epoch 1 to ``save``; returns the module's state."""
    lit = MomentumDLRM(C.make_net("collection"), LR, num_samples=EPOCH * world_size * C.LOCAL_BATCH)
    kwargs = C.trainer_kwargs(-1)
    kwargs["max_epochs"] = epochs
    callbacks = [] if save is None else [K.SaveAtEpochEnd(save)]
    trainer = pl.Trainer(devices=world_size, strategy=TwoDSparseStrategy(shard_group_size=2, **OPTIONS, **options),
                         callbacks=callbacks, **kwargs)
    trainer.fit(lit, ckpt_path=ckpt_path)
    return C.numpy_state(lit.state_dict())


def _train(fabric: Fabric, model, optimizer, loader: DataLoader, steps: int) -> None:
    """The first ``steps`` batches of ``loader`` in the Fabric loop."""
    for index, batch in enumerate(loader):
        if index == steps:
            break
        fabric.backward(model.training_step(batch, index))
        optimizer.step()
        optimizer.zero_grad()


def _drain_worker(rank: int, world_size: int, port: int, directory: str) -> dict:
    """Per case: the Trainer for one epoch (saved) and resumed for a second; the Fabric loop for one
    epoch, its state read with no call to drain, saved, two steps further (with ``sync_overlap`` a
    round is then in flight), loaded back and run for the second epoch; then the same two steps and
    ``load_state_dict`` of the state read before them."""
    C.as_external_rank(rank, world_size, port)
    out = {}
    for case, options in DRAIN_CASES.items():
        path = f"{directory}/{case.replace(' ', '_')}"
        out[f"trainer {case}"] = _trainer_epochs(world_size, 1, options, save=f"{path}_trainer")
        out[f"trainer resumed {case}"] = _trainer_epochs(world_size, 2, options, ckpt_path=f"{path}_trainer")

        fabric = Fabric(accelerator="cpu", devices=world_size,
                        strategy=TwoDSparseFabricStrategy(shard_group_size=2, **OPTIONS, **options))
        fabric.launch()
        lit = MomentumDLRM(C.make_net("collection"), LR)
        model, optimizer = fabric.setup(lit, lit.configure_optimizers())

        _train(fabric, model, optimizer, _loader(world_size, rank, EPOCH), EPOCH)
        out[f"fabric {case}"] = C.numpy_state(lit.state_dict())
        out[f"identical after reading {case}"] = all(C.replicas_identical(fabric.strategy))
        fabric.save(f"{path}_fabric", {"model": model, "optimizer": optimizer})
        _train(fabric, model, optimizer, _loader(world_size, rank, EPOCH), 2)
        fabric.load(f"{path}_fabric", {"model": model, "optimizer": optimizer})
        out[f"fabric loaded {case}"] = C.numpy_state(lit.state_dict())
        _train(fabric, model, optimizer, _loader(world_size, rank, EPOCH), EPOCH)
        out[f"fabric resumed {case}"] = C.numpy_state(lit.state_dict())
        out[f"identical at the end {case}"] = all(C.replicas_identical(fabric.strategy))

        state = {key: value.clone() for key, value in lit.state_dict().items()}
        _train(fabric, model, optimizer, _loader(world_size, rank, EPOCH), 2)
        lit.load_state_dict(state)  # the plain torch route: a round in flight is discarded there too
        out[f"state {case}"] = C.numpy_state(state)
        out[f"state loaded {case}"] = C.numpy_state(lit.state_dict())
    return out


@pytest.fixture(scope="module")
def drained(tmp_path_factory) -> list[dict]:
    return run_distributed(_drain_worker, C.WORLD, C.free_port(), str(tmp_path_factory.mktemp("drain")), timeout=420)


@pytest.mark.parametrize("case", DRAIN_CASES)
def test_reading_the_state_after_a_fabric_loop_sees_the_trainer_s_drained_weights(drained, case):
    for rank, result in enumerate(drained):
        assert result[f"identical after reading {case}"], f"rank {rank}: copies differ after reading the state"
        _close(result[f"fabric {case}"], result[f"trainer {case}"], 1e-6)


@pytest.mark.parametrize("case", DRAIN_CASES)
def test_a_fabric_load_discards_the_round_in_flight(drained, case):
    for rank, result in enumerate(drained):
        _close(result[f"fabric loaded {case}"], result[f"fabric {case}"], 0.0)  # the checkpoint, bit for bit
        _close(result[f"fabric resumed {case}"], result[f"trainer resumed {case}"], 1e-6)
        assert result[f"identical at the end {case}"], f"rank {rank}"
        _close(result[f"state loaded {case}"], result[f"state {case}"], 0.0)


# ----------------------------------------------------------------------------- spawned processes
def _spawned(fabric: Fabric) -> dict:
    lit = MomentumDLRM(C.make_net("collection"), LR)
    model, optimizer = fabric.setup(lit, lit.configure_optimizers())
    losses = []
    for index, batch in enumerate(_loader(fabric.world_size, fabric.global_rank, 3)):
        loss = model.training_step(batch, index)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    strategy = fabric.strategy
    return dict(losses=losses, groups=strategy.mesh_groups.dims.shard_groups(), steps=strategy.schedule.steps)


def test_fabric_launches_spawned_processes():
    environ = dict(os.environ)
    try:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="twod_sparse_spawn")
        result = fabric.launch(_spawned)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert isinstance(fabric.strategy, TwoDSparseFabricStrategy)
    assert result["steps"] == 3 and len(result["losses"]) == 3
    assert result["groups"] in ([[0], [1]], [[0, 1]])  # "auto": tiny tables fit one rank
