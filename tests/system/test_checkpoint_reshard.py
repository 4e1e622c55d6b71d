"""What a checkpoint does to the sparse optimizer across meshes, and to the int8 wire's residuals.

* Momentum-scaled row-wise AdaGrad steps by ``lr * g / (sqrt(v / c) + eps)`` with ``c`` set by the
  mesh (``M`` for sharded tables, ``W`` for data-parallel ones, 1 in ``sync_mode="gradients"``).
  A checkpoint loaded on another mesh keeps ``v / c``: a 2-process run saves after one epoch, a
  run on another mesh resumes it for a second epoch, and both checkpoints are compared with the
  emulator (``lightning_twod.testing.emulator``) running the first epoch on the first mesh and continuing
  on the second from the saved state with ``v`` times ``c_new / c_saved``. Cases: 2x1 -> 1x2 and
  back (sharded ``c`` 2 -> 1 and 1 -> 2), 2x1 -> 1x2 in gradients mode (the data-parallel table's
  ``c`` 2 -> 1 as well), and a numeric ``momentum_scale`` (the same ``c`` on both meshes). A
  checkpoint without the scales (an earlier version's) loads ``v`` as saved, with a warning.
* ``sync_dtype="int8"``: every drain (a save among them) flushes the copies' residuals into the
  weights, so a run resumed from a checkpoint equals, bit for bit, the run that saved it and went
  on, though the residuals are not saved.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_twod import TwoDSparseStrategy
from lightning_twod.sparse.optimizers import SparseOptimizerConfig, layout_optimizer
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C

WORLD = 2
STEPS = 4  # optimizer steps in an epoch
LR = 0.2  # dense SGD
ADA_LR = 0.05
EPS = 1e-3  # large enough that a wrong scale shows
SHARDING = {"t_user": "table_wise", "t_item": "row_wise", "t_cat": "data_parallel"}
TOLERANCE = 1e-5  # the emulator against real runs (test_layout_arithmetic.py)

# name: (source mesh's shard group size, target's, strategy options of the source, of the target)
RESHARDS = {
    "2x1 -> 1x2": (1, 2, {}, {}),
    "1x2 -> 2x1": (2, 1, {}, {}),
    "2x1 -> 1x2 gradients": (1, 2, {}, {"sync_mode": "gradients"}),
    "2x1 -> 1x2 momentum_scale=3": (1, 2, {"momentum_scale": 3.0}, {"momentum_scale": 3.0}),
}
# name: strategy options of a 2x1 int8 run
INT8 = {
    "int8": {"sync_dtype": "int8"},
    "int8 overlap interval 3": {"sync_dtype": "int8", "sync_overlap": True, "sync_interval": 3},
}


def _fit(group: int, epochs: int, ckpt_path=None, callbacks=(), **options):
    lit = C.LitDLRM(C.make_net("collection"), LR, num_samples=STEPS * WORLD * C.LOCAL_BATCH)
    strategy = TwoDSparseStrategy(shard_group_size=group, sharding=SHARDING, sparse_lr=ADA_LR, sparse_eps=EPS,
                                  **options)
    trainer = pl.Trainer(devices=WORLD, strategy=strategy, callbacks=list(callbacks),
                         **{**C.trainer_kwargs(-1), "max_epochs": epochs})
    trainer.fit(lit, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer, lit, strategy


def _reshard_worker(rank: int, world: int, port: int, root: str) -> list[str]:
    C.as_external_rank(rank, world, port)
    for index, (source, target, source_options, target_options) in enumerate(RESHARDS.values()):
        _fit(source, 1, callbacks=[K.SaveAtEpochEnd(f"{root}/{index}_saved", 1)], **source_options)
        _fit(target, 2, ckpt_path=f"{root}/{index}_saved", callbacks=[K.SaveAtEpochEnd(f"{root}/{index}_resumed", 2)],
             **target_options)
    # a checkpoint of an earlier version: no accumulator_scales, the sparse optimizer as the config's repr
    # (2x1's first one, loaded on 2x1)
    if rank == 0:
        shutil.copytree(f"{root}/0_saved", f"{root}/unscaled")
        layout = json.loads(Path(f"{root}/unscaled/layout.json").read_text())
        del layout["accumulator_scales"]
        layout["sparse_optimizer"] = repr(SparseOptimizerConfig(**layout["sparse_optimizer"]))
        Path(f"{root}/unscaled/layout.json").write_text(json.dumps(layout))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(1, 1, ckpt_path=f"{root}/unscaled")
    return [str(w.message) for w in caught if "accumulator" in str(w.message)]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> tuple[Path, list[list[str]]]:
    root = tmp_path_factory.mktemp("reshard")
    return root, K.run_ranks(_reshard_worker, WORLD, C.free_port(), str(root), timeout=420)


def _configs(group: int, options: dict):
    """The strategy's sparse optimizer configs (sharded, data-parallel) for ``options`` on 1 x ``group``."""
    return [layout_optimizer("momentum_rowwise_adagrad", ADA_LR, EPS, options.get("momentum_scale", "auto"),
                             data_parallel=dp, world_size=WORLD, shard_group_size=group,
                             sync_mode=options.get("sync_mode", "weights")) for dp in (False, True)]


def _emulator(net, group: int, options: dict) -> MeshEmulator:
    layout = EmulatedLayout(WORLD, group, options.get("sync_mode", "weights"), data_parallel=("t_cat",))
    sharded, data_parallel = _configs(group, options)
    return MeshEmulator(net, layout, sharded, lambda model, batch: model.loss(batch),
                        lambda params: torch.optim.SGD(params, lr=LR), data_parallel_sparse=data_parallel)


def _epoch(emulator: MeshEmulator) -> None:
    """One epoch on the batches the real ranks get (a sequential DistributedSampler), then the end of fit."""
    dataset = C.ClickDataset(STEPS * WORLD * C.LOCAL_BATCH)
    for step in range(STEPS):
        start = step * WORLD * C.LOCAL_BATCH
        emulator.step([C.collate([dataset[start + r + WORLD * i] for i in range(C.LOCAL_BATCH)])
                       for r in range(WORLD)])
    emulator.drain()


def _state(emulator: MeshEmulator) -> dict[str, torch.Tensor]:
    """The emulator's model and accumulators under the checkpoint's keys."""
    out = {f"state_dict.net.{key}": value for key, value in emulator.model.state_dict().items()}
    out.update({f"sparse_optimizer.net.{key}.momentum": states["momentum1"][0] for key, states in emulator.states.items()})
    return out


def _assert_close(saved: dict, expected: dict, what: str) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, atol=TOLERANCE, rtol=TOLERANCE,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


@pytest.mark.parametrize("name", list(RESHARDS))
def test_a_reshard_keeps_every_row_s_step_size(resharded, name):
    resharded, index = resharded[0], list(RESHARDS).index(name)
    source, target, source_options, target_options = RESHARDS[name]
    scales = [{key: config.momentum_scale for key, config in zip(("sharded", "data_parallel"), _configs(g, o))}
              for g, o in ((source, source_options), (target, target_options))]
    kinds = {"t_user": "sharded", "t_item": "sharded", "t_cat": "data_parallel"}
    saved, resumed = K.read_checkpoint(resharded / f"{index}_saved"), K.read_checkpoint(resharded / f"{index}_resumed")
    for path, scale in ((f"{index}_saved", scales[0]), (f"{index}_resumed", scales[1])):
        written = json.loads((resharded / path / "layout.json").read_text())["accumulator_scales"]
        assert written == {f"net.sparse.embedding_bags.{t}.weight": scale[kind] for t, kind in kinds.items()}, path

    # the first epoch on the source mesh: the emulator's run is the saved one
    net = C.make_net("collection")
    first = _emulator(net, source, source_options)
    _epoch(first)
    _assert_close(saved, _state(first), f"{name}: saved")

    # the second epoch on the target mesh, from the saved state with v / c kept
    ratio = {key: scales[1][kinds[key.split(".")[2]]] / scales[0][kinds[key.split(".")[2]]] for key in first.states}
    kept = {key: states["momentum1"][0] * ratio[key] for key, states in first.states.items()}
    _assert_close(resumed, _continued(net.state_dict(), target, target_options, kept), f"{name}: resumed")
    if any(r != 1.0 for r in ratio.values()):  # the check can fail: v as saved steps the rows otherwise
        as_saved = _continued(net.state_dict(), target, target_options, {k: s["momentum1"][0] for k, s in first.states.items()})
        assert max((resumed[k] - v).abs().max().item() for k, v in as_saved.items()) > 100 * TOLERANCE


def test_a_checkpoint_without_scales_loads_as_saved_and_says_so(resharded):
    """An earlier version wrote no accumulator_scales: v loads as saved, with one warning (rank 0)."""
    first, second = resharded[1]
    assert second == [] and len(first) == 1, resharded[1]
    assert "does not say by what its row-wise AdaGrad accumulators were divided" in first[0]
    assert "net.sparse.embedding_bags.t_item.weight" in first[0]


def _continued(model: dict, group: int, options: dict, states: dict) -> dict[str, torch.Tensor]:
    """The emulator's state after an epoch on 1 x ``group`` from the ``model`` state dict and the
    accumulators ``states`` (``{emulator key: [rows]}``)."""
    net = C.make_net("collection")
    net.load_state_dict(model)
    emulator = _emulator(net, group, options)
    for key in emulator.states:
        emulator.states[key]["momentum1"] = [states[key].clone() for _ in emulator.states[key]["momentum1"]]
    _epoch(emulator)
    return _state(emulator)


# ----------------------------------------------------------------------------- int8 resume
def _residuals(strategy) -> list[torch.Tensor]:
    """Every residual tensor of the int8 wire on this rank."""
    return [r for group in strategy.reducer.groups for kernel in group.residuals for shard in kernel for r in shard]


class _LargestResidual(Callback):
    """The largest residual of the int8 wire after any training step."""

    def __init__(self) -> None:
        self.largest = 0.0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.largest = max([self.largest, *(r.abs().max().item() for r in _residuals(trainer.strategy))])


def _int8_worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    out = {}
    for index, (name, options) in enumerate(INT8.items()):
        path = f"{root}/{index}"
        runs = {}
        for run, kwargs in (("saved and went on", dict(callbacks=[K.SaveAtEpochEnd(path, 1)])),
                            ("resumed", dict(ckpt_path=path)), ("never saved", {})):
            watch = _LargestResidual()
            trainer, lit, strategy = _fit(1, 2, callbacks=[watch, *kwargs.pop("callbacks", [])], **kwargs, **options)
            runs[run] = {**K.snapshot(trainer, lit, strategy), "largest residual": watch.largest,
                         "zero at end": all(not r.any() for r in _residuals(strategy)),
                         "identical": all(C.replicas_identical(strategy))}
        out[name] = runs
    return out


@pytest.fixture(scope="module")
def int8_runs(tmp_path_factory) -> list[dict]:
    return K.run_ranks(_int8_worker, WORLD, C.free_port(), str(tmp_path_factory.mktemp("int8")), timeout=420)


def _same(got: dict, want: dict) -> bool:
    return all(np.array_equal(got[part][k], want[part][k]) for part in ("model", "sparse_states") for k in want[part])


@pytest.mark.parametrize("name", list(INT8))
def test_an_int8_resume_is_bit_identical_to_the_run_that_saved(int8_runs, name):
    for rank, result in enumerate(int8_runs):
        runs = result[name]
        resumed, went_on = runs["resumed"], runs["saved and went on"]
        assert resumed["global_step"] == went_on["global_step"] == 2 * STEPS
        assert sorted(resumed["sparse_states"]) == sorted(went_on["sparse_states"])
        assert _same(resumed, went_on), f"rank {rank}: the resumed run differs from the one that saved"
        # the save's drain flushed the residuals into the weights: a run that never saved did not
        assert not _same(runs["never saved"], went_on), f"rank {rank}"
        for run in runs.values():
            assert run["largest residual"] > 0, f"rank {rank}: the wire dropped nothing: the test shows nothing"
            assert run["zero at end"] and run["identical"], f"rank {rank}: the end of fit drains and flushes"


