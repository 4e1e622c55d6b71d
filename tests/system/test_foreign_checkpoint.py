"""A single-file checkpoint of the unsharded model (written by ``strategy="ddp"``) resumes under
``TwoDSparseStrategy``: the tables are sliced into the shards, the dense optimizer's state is mapped
onto the dense parameters (the tables' entries dropped), the row-wise AdaGrad state starts at zero
with a warning, and the loops continue from the saved step.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_twod import TwoDSparseStrategy
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

DDP_STEPS = 4
MORE_STEPS = 2


def _named_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """The optimizer's per-parameter state keyed by parameter name."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    state = optimizer.state_dict()["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {by_id[id(p)]: C.numpy_state(state[i]) for i, p in enumerate(params) if i in state}


class AtTrainStart(Callback):
    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = dict(model=C.numpy_state(pl_module.state_dict()), step=trainer.global_step,
                         optimizer=_named_state(pl_module, trainer.optimizers[0]))


def _worker(rank: int, world_size: int, port: int, path: str) -> dict:
    C.as_external_rank(rank, world_size, port)
    lit = K.make_lit(world_size)  # Adam over every parameter, tables included
    ddp = pl.Trainer(devices=world_size, strategy="ddp", **C.trainer_kwargs(DDP_STEPS))
    ddp.fit(lit)
    ddp.save_checkpoint(path)
    saved = dict(model=C.numpy_state(lit.state_dict()), optimizer=_named_state(lit, ddp.optimizers[0]))
    K.leave_process_group()

    resumed = K.make_lit(world_size)
    strategy = TwoDSparseStrategy(shard_group_size=2, sharding={"t_item": "row_wise", "t_cat": "data_parallel"},
                                  sparse_lr=K.SPARSE_LR)
    watch = AtTrainStart()
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=[watch],
                         **C.trainer_kwargs(DDP_STEPS + MORE_STEPS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(resumed, ckpt_path=path)
    return dict(saved=saved, restored=watch.seen, global_step=trainer.global_step,
                warnings=[str(w.message) for w in caught], identical=all(C.replicas_identical(strategy)))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[dict]:
    path = tmp_path_factory.mktemp("ddp") / "ddp.ckpt"
    return run_distributed(_worker, C.WORLD, C.free_port(), str(path), timeout=300)


def test_tables_and_dense_weights_resume_from_a_ddp_checkpoint(run):
    for result in run:
        saved, restored = result["saved"]["model"], result["restored"]["model"]
        assert sorted(saved) == sorted(restored)
        for key, value in saved.items():
            torch.testing.assert_close(torch.as_tensor(restored[key]), torch.as_tensor(value), atol=0, rtol=0,
                                       msg=key)
        assert result["restored"]["step"] == DDP_STEPS and result["global_step"] == DDP_STEPS + MORE_STEPS
        assert result["identical"]


def test_the_dense_optimizer_state_is_mapped_and_the_tables_state_dropped(run):
    for result in run:
        saved, restored = result["saved"]["optimizer"], result["restored"]["optimizer"]
        dense = [name for name in saved if "embedding_bags" not in name]
        assert sorted(restored) == sorted(dense) and len(dense) == 4  # bottom and top, weight and bias
        for name in dense:
            for key, value in saved[name].items():
                torch.testing.assert_close(torch.as_tensor(restored[name][key]), torch.as_tensor(value), atol=0,
                                           rtol=0, msg=f"{name}.{key}")


def test_the_missing_rowwise_state_is_announced(run):
    messages = run[0]["warnings"]
    assert any("no momentum_rowwise_adagrad state for the embedding tables; it starts at zero" in m
               for m in messages), messages


