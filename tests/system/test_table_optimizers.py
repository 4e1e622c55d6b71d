"""Per-table sparse optimizer settings (``sparse_per_table``) through ``TwoDSparseStrategy`` on 4 processes.

The strategy trains with row-wise AdaGrad; ``t_item`` (row-wise, shared by two features) has partial row-wise
Adam with its own learning rate and betas, ``t_cat`` (data-parallel) AdaGrad at its own learning rate, ``t_user``
(table-wise) the strategy's. ``t_user`` and ``t_item`` are sharded in groups of 2: their kernels share one
replica group, one keeping Adam's exact states and the other not.

* in ``sync_mode="gradients"`` a 2x2 fit equals one process trained on the concatenated batch (the emulator on
  a 1x1 mesh with the same per-table configs), weights and every state;
* in ``sync_mode="weights"`` on the bf16 wire, overlapped, every 2 steps, a 2x2 fit equals the emulator: the
  second moment and step count of ``t_item`` go in the fp32 round (exact means), whatever ``t_user`` keeps;
* a checkpoint saved after epoch 1 resumes bit for bit; resumed with another optimizer for ``t_item``
  (``adam``, whose second moment is one an element) it is refused, naming the table.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.sparse.optimizers import layout_optimizer
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C

WORLD = C.WORLD
STEPS = 4  # optimizer steps in an epoch
LR = 0.2  # dense SGD
SPARSE_LR, EPS = 0.05, 1e-6
SHARDING = {"t_user": "table_wise", "t_item": "row_wise", "t_cat": "data_parallel"}
PER_TABLE = {"t_item": {"optimizer": "rowwise_adam", "lr": 0.02, "betas": (0.8, 0.95)}, "t_cat": {"lr": 0.2}}
ITEM = "sparse_optimizer.net.sparse.embedding_bags.t_item.weight"
FITS = {
    "gradients": dict(sync_mode="gradients"),
    "bf16 overlap interval 2": dict(sync_dtype="bf16", sync_overlap=True, sync_interval=2),
}
RESUMED = dict(sync_dtype="bf16", sync_overlap=True, sync_interval=3)


def _fit(options: dict, epochs: int = 1, ckpt_path=None, callbacks=(), per_table=None):
    lit = C.LitDLRM(C.make_net("collection"), LR, num_samples=STEPS * WORLD * C.LOCAL_BATCH)
    strategy = TwoDSparseStrategy(shard_group_size=2, sharding=SHARDING, sparse_optimizer="rowwise_adagrad",
                                  sparse_lr=SPARSE_LR, sparse_eps=EPS, kernel_backend="torch",
                                  sparse_per_table=PER_TABLE if per_table is None else per_table, **options)
    trainer = pl.Trainer(devices=WORLD, strategy=strategy, callbacks=list(callbacks),
                         **{**C.trainer_kwargs(-1), "max_epochs": epochs})
    trainer.fit(lit, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return strategy


class _Lines(logging.Handler):
    """The messages of the log records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    logged = _Lines()
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addHandler(logged)  # the set-up line (rank 0's)
    out = {}
    for index, options in enumerate(FITS.values()):
        strategy = _fit(options, callbacks=[K.SaveAtEpochEnd(f"{root}/{index}", 1)])
        out[index] = {"identical": all(C.replicas_identical(strategy)),
                      "optimizers": {p.tables[0].name: (p.optimizer.name, p.optimizer.lr)
                                     for p in strategy.sparse_modules["net.sparse"].parts()}}
    out["set-up"] = [line for line in logged.lines if "sparse_per_table" in line]
    saved = f"{root}/saved"
    _fit(RESUMED, 2, callbacks=[K.SaveAtEpochEnd(saved, 1), K.SaveAtEpochEnd(f"{root}/went_on", 2)])
    _fit(RESUMED, 2, ckpt_path=saved, callbacks=[K.SaveAtEpochEnd(f"{root}/resumed", 2)])
    try:
        _fit(RESUMED, 2, ckpt_path=saved, per_table={**PER_TABLE, "t_item": {"optimizer": "adam"}})
        out["other optimizer"] = "loaded"
    except Exception as err:  # noqa: BLE001 (the message is what the test reads)
        out["other optimizer"] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("per_table")
    return root, K.run_ranks(_worker, WORLD, C.free_port(), str(root), timeout=600)


def _emulator(options: dict, world: int = WORLD, group: int = 2) -> MeshEmulator:
    mode = options.get("sync_mode", "weights")
    layout = EmulatedLayout(world, group, mode, options.get("sync_interval", 1),
                            data_parallel=("t_cat",) if world > 1 else (), sync_dtype=options.get("sync_dtype", "fp32"),
                            sync_overlap=options.get("sync_overlap", False))

    def config(name: str, lr: float, data_parallel: bool = False, betas=(0.9, 0.999)):
        return layout_optimizer(name, lr, EPS, "auto", data_parallel=data_parallel, world_size=WORLD,
                                shard_group_size=2, sync_mode=mode, betas=betas)

    per_table = {"t_item": config("rowwise_adam", 0.02, betas=(0.8, 0.95)),
                 "t_cat": config("rowwise_adagrad", 0.2, data_parallel=True)}
    return MeshEmulator(C.make_net("collection"), layout, config("rowwise_adagrad", SPARSE_LR),
                        lambda model, batch: model.loss(batch), lambda params: torch.optim.SGD(params, lr=LR),
                        sparse_by_table=per_table)


def _state(emulator: MeshEmulator) -> dict[str, torch.Tensor]:
    """The emulator's model and states under the checkpoint's keys (row-wise AdaGrad's accumulator: ``.momentum``)."""
    out = {f"state_dict.net.{key}": value for key, value in emulator.model.state_dict().items()}
    for key, states in emulator.states.items():
        for name, per_copy in states.items():
            suffix = "momentum" if emulator.configs[key].name == "rowwise_adagrad" else name
            out[f"sparse_optimizer.net.{key}.{suffix}"] = per_copy[0]
    return out


def _assert_close(saved: dict, expected: dict, what: str, tolerance: float) -> None:
    assert set(expected) <= set(saved), sorted(set(expected) - set(saved))
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, atol=tolerance, rtol=tolerance,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


def test_each_table_trains_in_a_part_with_its_own_optimizer_named_at_set_up(fits):
    _, results = fits
    assert len(results[0]["set-up"]) == len(FITS), results[0]["set-up"]
    for line in results[0]["set-up"]:
        assert "sparse optimizer=SparseOptimizerConfig(name='rowwise_adagrad', lr=0.05" in line
        assert ("; sparse_per_table: 't_item': optimizer='rowwise_adam', lr=0.02, betas=(0.8, 0.95); "
                "'t_cat': lr=0.2\n") in line, line
    for result in results:
        assert result[0]["optimizers"] == {"t_user": ("rowwise_adagrad", SPARSE_LR), "t_item": ("rowwise_adam", 0.02),
                                           "t_cat": ("rowwise_adagrad", 0.2)}


def test_a_2x2_fit_in_gradients_mode_equals_one_process_on_the_concatenated_batch(fits):
    root, results = fits
    assert all(result[0]["identical"] for result in results)
    saved = K.read_checkpoint(root / "0")
    assert {key.rsplit(".", 1)[1] for key in saved if key.startswith(ITEM)} == {"momentum1", "momentum2", "step"}
    single = _emulator(FITS["gradients"], world=1, group=1)
    C.emulate_epoch(single, STEPS, ranks=1)
    _assert_close(saved, _state(single), "2x2 gradients against one process", 1e-5)
    assert saved[f"{ITEM}.step"].max() > 1, "rows touched on several steps"


def test_a_2x2_fit_on_the_bf16_wire_keeps_adams_exact_states_exact_beside_adagrad(fits):
    root, results = fits
    assert all(result[1]["identical"] for result in results)
    saved = K.read_checkpoint(root / "1")
    emulator = _emulator(FITS["bf16 overlap interval 2"])
    C.emulate_epoch(emulator, STEPS)
    expected = _state(emulator)
    # weights, momentum1 and the accumulators crossed the bf16 wire as rounded changes (test_adam_strategy.py)
    _assert_close(saved, expected, "bf16", 1e-3)
    for name in ("momentum2", "step"):  # exact fp32 means: within float rounding of the emulator's
        torch.testing.assert_close(saved[f"{ITEM}.{name}"], expected[f"{ITEM}.{name}"], rtol=1e-5, atol=1e-10)
    steps = saved[f"{ITEM}.step"]
    assert (steps != steps.round()).any(), "the mean over copies that touched a row on different steps"


def test_a_checkpoint_resumes_exactly_and_refuses_another_optimizer_for_a_table(fits):
    root, results = fits
    went_on, resumed = K.read_checkpoint(root / "went_on"), K.read_checkpoint(root / "resumed")
    assert set(went_on) == set(resumed)
    assert {key.rsplit(".", 1)[1] for key in went_on if key.startswith(ITEM)} == {"momentum1", "momentum2", "step"}
    for key, value in went_on.items():
        assert torch.equal(resumed[key], value), f"{key} differs after the resume"
    for result in results:  # on every rank
        message = result["other optimizer"]
        assert "table net.sparse.embedding_bags.t_item.weight was saved with sparse optimizer 'rowwise_adam'" \
            in message, message
        assert "sparse_per_table" in message, message
