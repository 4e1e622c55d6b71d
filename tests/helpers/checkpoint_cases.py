"""Shared model, fits and checkpoint readers of the checkpoint tests (``test_checkpoint.py``).

The model is ``strategy_cases``' small DLRM with a *stateful* dense optimizer (Adam) and all three
sharded layouts: ``t_user`` column-wise, ``t_item`` row-wise, ``t_cat`` table-wise; the sparse
optimizer is row-wise AdaGrad. An epoch is ``STEPS_PER_EPOCH`` optimizer steps of ``GLOBAL``
samples on any world size (the local batch is ``GLOBAL // world``), so the same data order holds
for every mesh and checkpoints at epoch ends resume exactly.

Process runs follow ``test_strategy.py``: children of ``run_ranks`` (``run_distributed``, started
from its preloaded forkserver) pose as externally launched ranks
(``strategy_cases.as_external_rank``) and run several Trainers one after another; ``run_ranks(...,
dead=r)`` is for runs in which rank ``r`` is meant to die (``os._exit``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_twod import TwoDSparseStrategy
from lightning_twod.checkpoint.directory import check_complete
from lightning_twod.checkpoint.format import SafeFileSystemReader
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

run_ranks = run_distributed  # the checkpoint tests' name for it
GLOBAL = C.WORLD * C.LOCAL_BATCH  # samples per optimizer step, all ranks together
STEPS_PER_EPOCH = 4
NUM_SAMPLES = GLOBAL * STEPS_PER_EPOCH
EPOCHS = 2
DENSE_LR = 0.01  # Adam
SPARSE_LR = 0.05  # row-wise AdaGrad
SHARDING = {"t_user": "column_wise", "t_item": "row_wise", "t_cat": "table_wise"}  # pinned: the planner obeys
COLUMN_WISE = "net.sparse.embedding_bags.t_user.weight"  # its LightningModule state_dict key
TABLE_KEYS = [f"net.sparse.embedding_bags.{name}.weight" for name, *_ in C.TABLES]
# A checkpoint of format 1 (tables written through torch's ShardedTensor; see tests/data/README.md):
# this model after epoch 1 on 2x2 (``fit(4, 2, 1, callbacks=[SaveAtEpochEnd(path)])``).
FORMAT1 = Path(__file__).resolve().parents[1] / "data" / "checkpoint_format1_2x2"


class AdamDLRM(C.LitDLRM):
    """``LitDLRM`` with Adam: the dense optimizer has state (``step``, ``exp_avg``, ``exp_avg_sq``)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=DENSE_LR)


def make_lit(world: int) -> AdamDLRM:
    return AdamDLRM(C.make_net("collection"), DENSE_LR, batch_size=GLOBAL // world, num_samples=NUM_SAMPLES)


def make_strategy(shard_group_size: int, sharding: dict | None = None, **kwargs) -> TwoDSparseStrategy:
    return TwoDSparseStrategy(shard_group_size=shard_group_size, sharding=sharding or SHARDING, sparse_lr=SPARSE_LR,
                              **kwargs)


def make_trainer(world: int, strategy, epochs: int, callbacks=(), checkpointing: bool = False) -> pl.Trainer:
    kwargs = C.trainer_kwargs(-1)
    kwargs.update(max_epochs=epochs, enable_checkpointing=checkpointing)
    return pl.Trainer(devices=world, strategy=strategy, callbacks=list(callbacks), **kwargs)


def fit(world: int, shard_group_size: int, epochs: int, ckpt_path=None, callbacks=(), checkpointing=False,
        **strategy_kwargs):
    """``(trainer, module, strategy)`` after ``Trainer.fit`` for ``epochs`` epochs."""
    lit = make_lit(world)
    strategy = make_strategy(shard_group_size, **strategy_kwargs)
    trainer = make_trainer(world, strategy, epochs, callbacks, checkpointing)
    trainer.fit(lit, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer, lit, strategy


def snapshot(trainer, lit, strategy) -> dict:
    """Everything a resume must reproduce, as numpy arrays (a collective: call on every rank).

    ``model``: the LightningModule's state dict (full tables, assembled on every rank);
    ``dense_optimizer``: the tensors of ``trainer.optimizers[0].state_dict()``;
    ``sparse_states``: this rank's sparse optimizer states, kernel by kernel, shard by shard, by name.
    """
    dense = trainer.optimizers[0].state_dict()
    sparse = {}
    for path, module in strategy.sparse_modules.items():
        for k, kernel in enumerate(module.kernels()):
            for s, states in enumerate(kernel.shard_states()):
                sparse.update({f"{path}/kernel{k}/shard{s}/{name}": state for name, state in states.items()})
    return {
        "model": C.numpy_state(lit.state_dict()),
        "dense_optimizer": C.numpy_state({f"{i}.{name}": value for i, values in dense["state"].items()
                                          for name, value in values.items()}),
        "dense_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in dense["param_groups"]],
        "sparse_states": C.numpy_state(sparse),
        "global_step": trainer.global_step, "epoch": trainer.current_epoch, "seen": len(lit.seen),
        "kernels": sorted({type(k).__name__ for m in strategy.sparse_modules.values() for k in m.kernels()}),
    }


class SaveAtEpochEnd(Callback):
    """``trainer.save_checkpoint(path)`` at the end of epoch ``epoch`` (1-based)."""

    def __init__(self, path, epoch: int = 1) -> None:
        self.path = str(path)
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch + 1 == self.epoch:
            trainer.save_checkpoint(self.path)


def reshard(world: int, shard_group_size: int, source, target, **strategy_kwargs) -> dict:
    """Load ``source`` (saved at an epoch end) on this mesh and save it again at ``target`` without
    training: ``fit`` from it with ``max_epochs`` = its epoch count, then ``trainer.save_checkpoint``.

    The save and a second load of ``source`` (``strategy.load_checkpoint``, in place) run under
    ``warnings.catch_warnings``: ``warnings`` lists what they emitted (``"Category: message"``).
    """
    state = torch.load(Path(source) / "trainer_state.pt", weights_only=True)
    epochs = state["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]  # epochs it holds
    trainer, lit, strategy = fit(world, shard_group_size, epochs, ckpt_path=source, **strategy_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(str(target))
        strategy.load_checkpoint(str(source))
    return {"plan": strategy.sparse_modules["net.sparse"].describe_plan(), "global_step": trainer.global_step,
            "seen": len(lit.seen), "saved_step": state["global_step"], "column_blocks": column_blocks(strategy),
            "kernels": sorted({type(k).__name__ for m in strategy.sparse_modules.values() for k in m.kernels()}),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def leave_process_group() -> None:
    """Drop the harness's process group, so that Lightning creates its own with the strategy's
    ``timeout`` (it reuses an existing group as it is)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- reading checkpoints
def read_checkpoint(path) -> dict[str, torch.Tensor]:
    """Every tensor of a complete distributed checkpoint, full size, on one process (no group)."""
    import torch.distributed.checkpoint as dcp

    path = check_complete(path)
    reader = SafeFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in saved.items()
             if hasattr(md, "size")}
    with warnings.catch_warnings():  # that no process group exists: none is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def column_blocks(strategy) -> list[tuple[int, int]]:
    """``[(first column, end column)]`` of the column-wise table's blocks in the strategy's plan."""
    plan = strategy.sparse_modules["net.sparse"].plan["t_user"]
    return sorted({(shard.col_start, shard.col_end) for shard in plan.shards})


def column_state_after_load(saved: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """The per-column AdaGrad state ``[rows, dim]`` that loading ``saved`` into column ``blocks``
    and saving again gives (``lightning_twod.checkpoint.tables``'s rule): a block lying inside one saved
    block keeps its value exactly; a block spanning several takes the mean over its columns."""
    out = torch.empty_like(saved)
    for lo, hi in blocks:
        part = saved[:, lo:hi]
        constant = (part == part[:, :1]).all(dim=1)
        value = torch.where(constant, part[:, 0], part.mean(dim=1))
        out[:, lo:hi] = value.unsqueeze(1)
    return out
