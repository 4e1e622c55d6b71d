"""The Adam family through ``TwoDSparseStrategy`` on 4 processes: every state of every replicated shard
kept consistent, and checkpointed.

* 2x2 fits against the emulator (``lightning_twod.testing.emulator``), weights and every state, read
  from the checkpoint each fit saves at its end: ``adam`` and ``rowwise_adam`` at interval 1 on the fp32
  wire and overlapped on the bf16 wire (the copies bit-identical after the end of fit's drain),
  ``adamw`` on the int8 wire, ``lamb`` at interval 2, ``adam`` with a column-wise table (its state is
  element-wise: a cut by columns keeps its arithmetic);
* in ``sync_mode="gradients"`` a 2x2 fit equals one process trained on the concatenated batch (the
  emulator on a 1x1 mesh), weights and every state: the exact 1D semantics hold for the Adam family;
* a checkpoint saved on 2x2 resumes bit for bit, loads on 1x4 and on a per-table layout (and trains on
  there as the emulator does from the saved state, every state as saved) and consolidates.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.checkpoint.export import consolidate
from lightning_twod.sparse.optimizers import layout_optimizer
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C

WORLD = C.WORLD
STEPS = 4  # optimizer steps in an epoch
LR = 0.2  # dense SGD
SPARSE_LR, EPS, BETAS = 0.05, 1e-6, (0.8, 0.95)
SHARDING = {"t_user": "table_wise", "t_item": "row_wise", "t_cat": "data_parallel"}
TOLERANCE = 1e-5
STATES = {"adam": ("momentum1", "momentum2", "step"), "rowwise_adam": ("momentum1", "momentum2", "step")}

# name: strategy options of a 2x2 fit of one epoch, compared with the emulator
FITS = {
    "adam": dict(sparse_optimizer="adam"),
    "rowwise_adam": dict(sparse_optimizer="rowwise_adam"),
    "adam bf16 overlap interval 2": dict(sparse_optimizer="adam", sync_dtype="bf16", sync_overlap=True,
                                         sync_interval=2),
    "rowwise_adam bf16 overlap interval 2": dict(sparse_optimizer="rowwise_adam", sync_dtype="bf16",
                                                 sync_overlap=True, sync_interval=2),
    "adamw int8 decay": dict(sparse_optimizer="adamw", sync_dtype="int8", sparse_weight_decay=0.1),
    "lamb interval 2 decay": dict(sparse_optimizer="lamb", sync_interval=2, sparse_weight_decay=0.1),
    "adam column-wise": dict(sparse_optimizer="adam", sharding={**SHARDING, "t_user": "column_wise"}),
    "adam gradients": dict(sparse_optimizer="adam", sync_mode="gradients"),
    "rowwise_adam gradients": dict(sparse_optimizer="rowwise_adam", sync_mode="gradients"),
}
PER_TABLE = {"t_user": {"type": "table_wise", "shard_group_size": 1}, "t_item": {"type": "row_wise", "shard_group_size": 4},
             "t_cat": "data_parallel"}


def _strategy(options: dict) -> TwoDSparseStrategy:
    options = {"shard_group_size": 2, "sharding": SHARDING, **options}
    return TwoDSparseStrategy(sparse_lr=SPARSE_LR, sparse_eps=EPS, sparse_betas=BETAS, kernel_backend="torch",
                              **options)


def _fit(options: dict, epochs: int = 1, ckpt_path=None, callbacks=()):
    lit = C.LitDLRM(C.make_net("collection"), LR, num_samples=STEPS * WORLD * C.LOCAL_BATCH)
    strategy = _strategy(options)
    trainer = pl.Trainer(devices=WORLD, strategy=strategy, callbacks=list(callbacks),
                         **{**C.trainer_kwargs(-1), "max_epochs": epochs})
    trainer.fit(lit, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer, lit, strategy


def _worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    out = {}
    for index, (name, options) in enumerate(FITS.items()):
        _, _, strategy = _fit(options, callbacks=[K.SaveAtEpochEnd(f"{root}/{index}", 1)])
        out[name] = all(C.replicas_identical(strategy))
    for optimizer in STATES:  # saved after epoch 1 of 2 and went on; resumed from it; loaded elsewhere
        options = {**FITS[optimizer], "sync_dtype": "bf16", "sync_overlap": True, "sync_interval": 3}
        path = f"{root}/{optimizer}_saved"
        runs = {}
        for run, kwargs in (("saved and went on", dict(callbacks=[K.SaveAtEpochEnd(path, 1)])),
                            ("resumed", dict(ckpt_path=path))):
            trainer, lit, strategy = _fit(options, 2, **kwargs)
            runs[run] = K.snapshot(trainer, lit, strategy)
        out[optimizer] = runs
        for target, sharding in (("1x4", {"shard_group_size": 4}), ("per_table", {"sharding": PER_TABLE})):
            _fit({**FITS[optimizer], **sharding}, 2, ckpt_path=path,
                 callbacks=[K.SaveAtEpochEnd(f"{root}/{optimizer}_{target}", 2)])
    return out


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("adam")
    return root, K.run_ranks(_worker, WORLD, C.free_port(), str(root), timeout=600)


def _emulator(net, options: dict, group_sizes: tuple = ()) -> MeshEmulator:
    group, mode = options.get("shard_group_size", 2), options.get("sync_mode", "weights")
    layout = EmulatedLayout(WORLD, group, mode, options.get("sync_interval", 1), data_parallel=("t_cat",),
                            sync_dtype=options.get("sync_dtype", "fp32"), sync_overlap=options.get("sync_overlap", False),
                            group_sizes=group_sizes)
    sharded, data_parallel = [layout_optimizer(options["sparse_optimizer"], SPARSE_LR, EPS, "auto", data_parallel=dp,
                                               world_size=WORLD, shard_group_size=group, sync_mode=mode, betas=BETAS,
                                               weight_decay=options.get("sparse_weight_decay", 0.0))
                              for dp in (False, True)]
    return MeshEmulator(net, layout, sharded, lambda model, batch: model.loss(batch),
                        lambda params: torch.optim.SGD(params, lr=LR), data_parallel_sparse=data_parallel)


def _state(emulator: MeshEmulator) -> dict[str, torch.Tensor]:
    """The emulator's model and states under the checkpoint's keys."""
    out = {f"state_dict.net.{key}": value for key, value in emulator.model.state_dict().items()}
    out.update({f"sparse_optimizer.net.{key}.{name}": per_copy[0]
                for key, states in emulator.states.items() for name, per_copy in states.items()})
    return out


def _as_saved(saved: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the checkpoint holds it: a row's state of a column-wise table once per column."""
    return value.unsqueeze(1).expand_as(saved) if saved.dim() == 2 and value.dim() == 1 else value


def _assert_close(saved: dict, expected: dict, what: str, tolerance: float = TOLERANCE) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], _as_saved(saved[key], value), atol=tolerance, rtol=tolerance,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


@pytest.mark.parametrize("name", list(FITS))
def test_a_2x2_fit_keeps_every_state_as_the_emulator_does(fits, name):
    root, results = fits
    options = FITS[name]
    assert all(result[name] for result in results), f"{name}: copies differ after the end of fit's drain"
    saved = K.read_checkpoint(root / str(list(FITS).index(name)))
    states = {key.rsplit(".", 1)[1] for key in saved if key.startswith("sparse_optimizer.")}
    assert states == {"momentum1", "momentum2", "step"}, states
    emulator = _emulator(C.make_net("collection"), options)
    C.emulate_epoch(emulator, STEPS)
    expected = _state(emulator)
    # bf16: a change the real arithmetic and the emulator's round to neighbouring bf16 values differs by
    # one bf16 step (2.4e-4 of the largest changes here), which an overlapped round leaves in full in the
    # copy until the drain (test_layout_arithmetic.py says more); the exact states are sent in fp32
    _assert_close(saved, expected, name, 1e-3 if options.get("sync_dtype") == "bf16" else TOLERANCE)
    steps = saved["sparse_optimizer.net.sparse.embedding_bags.t_item.weight.step"]
    assert steps.max() > 1 and steps.min() < STEPS, "rows touched on some steps, not all"
    if options.get("sync_mode") != "gradients":  # the mean over copies that touched a row on different steps
        assert (steps != steps.round()).any(), steps
    single = MeshEmulator(C.make_net("collection"), EmulatedLayout(1, 1), emulator.sparse,
                          lambda model, batch: model.loss(batch), lambda params: torch.optim.SGD(params, lr=LR))
    C.emulate_epoch(single, STEPS, ranks=1)  # one process on the concatenated batch: 1D training
    if options.get("sync_mode") == "gradients":  # the 1D trajectory, every state included
        _assert_close(saved, _state(single), f"{name}: against one process")
    else:  # averaging weights and states is not 1D for Adam (the module docstring of sparse.optimizers)
        differs = [(saved[key] - _as_saved(saved[key], value)).abs().max().item() > 100 * TOLERANCE
                   for key, value in _state(single).items()
                   if key.startswith("sparse_optimizer.")]
        assert any(differs), f"{name}: the weights reduction gave 1D's states: the emulator check shows nothing"


@pytest.mark.parametrize("optimizer", list(STATES))
def test_a_2x2_checkpoint_resumes_exactly_reshards_and_consolidates(fits, optimizer):
    root, results = fits
    for rank, result in enumerate(results):
        resumed, went_on = result[optimizer]["resumed"], result[optimizer]["saved and went on"]
        assert resumed["global_step"] == went_on["global_step"] == 2 * STEPS
        names = {key.rsplit("/", 1)[1] for key in went_on["sparse_states"]}
        assert names == set(STATES[optimizer]), names
        for part in ("model", "sparse_states"):
            for key, want in went_on[part].items():
                assert (resumed[part][key] == want).all(), f"rank {rank}: {part} {key} differs after the resume"
    saved = K.read_checkpoint(root / f"{optimizer}_saved")
    options = {**FITS[optimizer], "sync_dtype": "bf16", "sync_overlap": True, "sync_interval": 3}
    net = C.make_net("collection")
    first = _emulator(net, options)
    C.emulate_epoch(first, STEPS)
    _assert_close(saved, _state(first), f"{optimizer}: saved on 2x2", 1e-3)  # bf16 overlapped: as above
    state = consolidate(root / f"{optimizer}_saved")  # the unsharded model's state dict, no optimizer state
    assert set(state) == {f"net.{key}" for key in first.model.state_dict()}
    for key in first.model.state_dict():
        assert torch.equal(state[f"net.{key}"], saved[f"state_dict.net.{key}"]), key
    for target, options, sizes in (("1x4", {"shard_group_size": 4}, ()),
                                   ("per_table", {}, (("t_user", 1), ("t_item", 4)))):
        second_net = C.make_net("collection")
        second_net.load_state_dict({key: saved[f"state_dict.net.{key}"] for key in net.state_dict()})
        second = _emulator(second_net, {**FITS[optimizer], **options}, sizes)
        for key, states in second.states.items():
            for name, per_copy in states.items():
                per_copy[:] = [saved[f"sparse_optimizer.net.{key}.{name}"].clone() for _ in per_copy]
        C.emulate_epoch(second, STEPS)
        _assert_close(K.read_checkpoint(root / f"{optimizer}_{target}"), _state(second), f"{optimizer}: on {target}")
