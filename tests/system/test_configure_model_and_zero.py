"""What Lightning users do, under ``TwoDSparseStrategy`` on 2 gloo processes (a 1x2 mesh):

* tables built in the LightningModule's ``configure_model`` hook (Lightning calls it after the
  process group exists, before the strategy's ``setup``) are planned and sharded, and the model
  trains exactly as the same model built in ``__init__``;
* a dense ``torch.distributed.optim.ZeroRedundancyOptimizer`` (each rank holds the state of its
  part of the parameters) is saved consolidated in the distributed checkpoint: a fit resumed from
  it continues exactly as the uninterrupted one, every rank's part of the state included, and a
  plain optimizer resumes from it too; a Fabric loop with one saves and resumes the same way; a
  single-file checkpoint of ``strategy="ddp"`` with one (tables in it) gives each rank its part of
  the dense parameters' state;
* Fabric has no ``configure_model``: a module built under ``fabric.init_module(empty_init=True)``
  (uninitialized memory) is sharded as it is, and ``fabric.load`` then gives it the saved model exactly.

The model, data and fits are ``checkpoint_cases``' (Adam, pinned column-, row- and table-wise
tables, row-wise AdaGrad; checkpoints at an epoch end resume exactly).
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod import TwoDSparseFabricStrategy
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

WORLD = 2


class LazyAdamDLRM(K.AdamDLRM):
    """``checkpoint_cases``' model with the whole net, tables included, built in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__(None, K.DENSE_LR, batch_size=K.GLOBAL // WORLD, num_samples=K.NUM_SAMPLES)

    def configure_model(self) -> None:
        if self.net is None:  # Lightning calls the hook at every fit, validate, test and predict
            self.net = C.make_net("collection")


class ZeroDLRM(K.AdamDLRM):
    """Adam on the dense parameters, its state partitioned over the ranks (ZeRO stage 1)."""

    def configure_optimizers(self):
        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=K.DENSE_LR)


def _fit(lit, epochs: int, ckpt_path=None, callbacks=()) -> dict:
    """Fit ``lit`` on the 1x2 mesh; the full model state and this rank's part of the dense optimizer state."""
    trainer = K.make_trainer(WORLD, K.make_strategy(2), epochs, callbacks)
    trainer.fit(lit, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = local.state_dict()["state"]
    names = {id(p): name for name, p in lit.named_parameters()}
    return {"model": C.numpy_state(lit.state_dict()), "global_step": trainer.global_step,
            "tables": sorted(trainer.strategy.sparse_modules),
            "owned": sorted(names[id(p)] for group in local.param_groups for p in group["params"]),
            "optimizer": C.numpy_state({f"{i}.{k}": v for i, values in state.items() for k, v in values.items()})}


def _by_name(module: torch.nn.Module, parameters: list, state: dict) -> dict[str, dict]:
    """``state`` (an optimizer state numbering ``parameters``) keyed by the parameters' names in ``module``."""
    names = {id(p): name for name, p in module.named_parameters()}
    return {names[id(p)]: C.numpy_state(state[i]) for i, p in enumerate(parameters) if i in state}


def _ddp_zero_then_twod(path: str) -> dict:
    """A ``strategy="ddp"`` fit with ZeRO over every parameter saves one file; a 2D fit with ZeRO resumes from it.
    The saved state by parameter name, and what each rank's ZeRO holds when the resumed fit starts."""
    lit = ZeroDLRM(C.make_net("collection"), K.DENSE_LR, batch_size=K.GLOBAL // WORLD, num_samples=K.NUM_SAMPLES)
    ddp = pl.Trainer(devices=WORLD, strategy="ddp", **C.trainer_kwargs(K.STEPS_PER_EPOCH))
    ddp.fit(lit)
    ddp.save_checkpoint(path)
    parameters = [p for group in ddp.optimizers[0].param_groups for p in group["params"]]
    saved = _by_name(lit, parameters, torch.load(path, weights_only=True)["optimizer_states"][0]["state"])
    K.leave_process_group()
    restored = {}

    class AtTrainStart(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            local = trainer.optimizers[0].optim
            restored.update(_by_name(pl_module, [p for g in local.param_groups for p in g["params"]],
                                     local.state_dict()["state"]))

    resumed = ZeroDLRM(C.make_net("collection"), K.DENSE_LR, batch_size=K.GLOBAL // WORLD, num_samples=K.NUM_SAMPLES)
    trainer = pl.Trainer(devices=WORLD, strategy=K.make_strategy(2), callbacks=[AtTrainStart()],
                         **C.trainer_kwargs(K.STEPS_PER_EPOCH + 2))
    trainer.fit(resumed, ckpt_path=path)
    return {"saved": saved, "restored": restored, "global_step": trainer.global_step}


def _fabric_zero(rank: int, steps: int, skip: int = 0, load: str | None = None, save: str | None = None) -> dict:
    """A Fabric loop with a ZeRO Adam (built after the set-up, on the dense parameters): ``steps`` steps
    after ``skip`` batches; the full model state."""
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=TwoDSparseFabricStrategy(
        shard_group_size=2, sharding=K.SHARDING, sparse_lr=K.SPARSE_LR))
    fabric.launch()
    lit = K.AdamDLRM(C.make_net("collection"), K.DENSE_LR)
    model = fabric.setup_module(lit)
    optimizer = fabric.setup_optimizers(ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                                                lr=K.DENSE_LR))
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer})
    dataset = C.ClickDataset((skip + steps) * WORLD * C.LOCAL_BATCH)
    sampler = DistributedSampler(dataset, WORLD, rank, shuffle=False)
    for index, batch in enumerate(DataLoader(dataset, batch_size=C.LOCAL_BATCH, sampler=sampler, collate_fn=C.collate)):
        if index >= skip:
            fabric.backward(model.training_step(batch, index))
            optimizer.step()
            optimizer.zero_grad()
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer})
    return C.numpy_state(lit.state_dict())


def _fabric_empty_init(load: str) -> dict:
    """A module built under ``fabric.init_module(empty_init=True)``, set up and loaded from ``load``."""
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=TwoDSparseFabricStrategy(
        shard_group_size=2, sharding=K.SHARDING, sparse_lr=K.SPARSE_LR))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        lit = K.AdamDLRM(C.make_net("collection"), K.DENSE_LR)
    model = fabric.setup_module(lit)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=K.DENSE_LR))
    fabric.load(load, {"model": model, "optimizer": optimizer})
    return C.numpy_state(lit.state_dict())


def _worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    epochs = K.EPOCHS

    def zero() -> ZeroDLRM:
        return ZeroDLRM(C.make_net("collection"), K.DENSE_LR, batch_size=K.GLOBAL // world, num_samples=K.NUM_SAMPLES)

    out = {"eager": _fit(K.make_lit(world), epochs), "lazy": _fit(LazyAdamDLRM(), epochs)}
    out["zero uninterrupted"] = _fit(zero(), epochs)
    out["zero epoch 1"] = _fit(zero(), 1, callbacks=[K.SaveAtEpochEnd(f"{root}/zero_e1")])
    out["zero resumed"] = _fit(zero(), epochs, ckpt_path=f"{root}/zero_e1")
    out["adam resumed from zero"] = _fit(K.make_lit(world), epochs, ckpt_path=f"{root}/zero_e1")
    out["fabric uninterrupted"] = _fabric_zero(rank, 6)
    _fabric_zero(rank, 3, save=f"{root}/fabric_zero")
    out["fabric resumed"] = _fabric_zero(rank, 3, skip=3, load=f"{root}/fabric_zero")
    out["fabric saved"] = _fabric_zero(rank, 0, skip=3, load=f"{root}/fabric_zero")  # the checkpoint's model
    out["fabric empty init"] = _fabric_empty_init(f"{root}/fabric_zero")
    out["ddp single file"] = _ddp_zero_then_twod(f"{root}/ddp_zero.ckpt")  # last: it replaces the process group
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, WORLD, C.free_port(), str(tmp_path_factory.mktemp("zero")), timeout=400)


def _equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_tables_built_in_configure_model_are_sharded_and_train_as_built_in_init(ranks):
    initial = C.make_net("collection").state_dict()
    for result in ranks:
        lazy, eager = result["lazy"], result["eager"]
        assert lazy["tables"] == eager["tables"] == ["net.sparse"]
        assert lazy["global_step"] == eager["global_step"] == K.EPOCHS * K.STEPS_PER_EPOCH
        _equal(lazy["model"], eager["model"])
        for key in K.TABLE_KEYS:  # trained: the equality is not that of two untouched models
            assert not np.allclose(lazy["model"][key], initial[key.removeprefix("net.")].numpy(), atol=1e-4), key


def test_a_zero_optimizer_resumes_exactly_from_a_distributed_checkpoint(ranks):
    for rank, result in enumerate(ranks):
        resumed, uninterrupted = result["zero resumed"], result["zero uninterrupted"]
        assert resumed["global_step"] == uninterrupted["global_step"] == K.EPOCHS * K.STEPS_PER_EPOCH
        _equal(resumed["model"], uninterrupted["model"])
        # each rank holds the Adam state of its own parameters only, restored bit for bit
        assert resumed["optimizer"], f"rank {rank} holds no optimizer state"
        _equal(resumed["optimizer"], uninterrupted["optimizer"])
    owned = [set(result["zero resumed"]["owned"]) for result in ranks]
    assert all(owned) and not owned[0] & owned[1]  # the state really was partitioned


def test_a_plain_optimizer_resumes_from_a_zero_checkpoint(ranks):
    for result in ranks:
        got, want = result["adam resumed from zero"]["model"], result["zero uninterrupted"]["model"]
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-6, err_msg=key)


def test_a_fabric_loop_with_a_zero_optimizer_resumes_as_the_uninterrupted_one(ranks):
    for result in ranks:
        got, want = result["fabric resumed"], result["fabric uninterrupted"]
        assert sorted(got) == sorted(want)
        for key, value in want.items():  # (Fabric's DDP rebuilds its buckets after the first step: ~1e-8)
            np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-6, err_msg=key)


def test_a_fabric_module_built_with_empty_init_loads_a_checkpoint_exactly(ranks):
    for result in ranks:
        _equal(result["fabric empty init"], result["fabric saved"])


def test_a_zero_state_of_a_ddp_single_file_checkpoint_resumes_under_the_strategy(ranks):
    saved = ranks[0]["ddp single file"]["saved"]
    dense = sorted(name for name in saved if "embedding_bags" not in name)
    assert len(dense) == 4 and len(saved) == 4 + len(C.TABLES)  # bottom and top (weight, bias), and the tables
    held = []
    for result in ranks:
        run = result["ddp single file"]
        assert run["global_step"] == K.STEPS_PER_EPOCH + 2
        assert run["restored"] and set(run["restored"]) <= set(dense)  # the tables' state is dropped
        for name, values in run["restored"].items():
            _equal(values, saved[name])
        held += list(run["restored"])
    assert sorted(held) == dense  # each dense parameter's state on exactly one rank
