"""Checkpoints of fp16 tables through ``TwoDSparseStrategy`` on 2 gloo processes (a 2x1 mesh: two copies).

The tests' DLRM with ``t_item`` (row-wise) and ``t_cat`` (data-parallel) in fp16, ``t_user`` in fp32; row-wise
AdaGrad, the bf16 wire overlapped every 3 steps (a round in flight at every save):

* an fp16 table saves as fp16, its state as fp32;
* the run that saved after epoch 1 of 2, continued, equals the run resumed from that checkpoint, bit for bit;
* a checkpoint of fp32 tables loads into fp16 ones rounded to nearest, and one of fp16 tables into fp32 ones
  exactly (widened); the optimizer states load as saved;
* ``consolidate`` gives the unsharded model's state dict, fp16 tables in fp16.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, TwoDSparseStrategy
from lightning_twod.checkpoint.export import consolidate
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C

WORLD = 2
STEPS = 4  # optimizer steps in an epoch
LR = 0.2
HALF = {"t_user": "fp32", "t_item": "fp16", "t_cat": "fp16"}
FULL = {name: "fp32" for name in HALF}
OPTIONS = dict(shard_group_size=1, sharding={"t_user": "table_wise", "t_item": "row_wise", "t_cat": "data_parallel"},
               sparse_optimizer="rowwise_adagrad", sparse_lr=0.05, sparse_eps=1e-3, kernel_backend="torch",
               sync_dtype="bf16", sync_overlap=True, sync_interval=3)
TABLES = [f"net.sparse.embedding_bags.{name}.weight" for name in HALF]


def _net(dtypes: dict[str, str]) -> C.CollectionNet:
    """The tests' DLRM with tables of ``dtypes``, fp16 rows rounded to nearest from the same fp32 draws."""
    net = C.make_net("collection")
    sparse = EmbeddingBagCollection([EmbeddingTableConfig(name, rows, dim, feats, dtype=dtypes[name])
                                     for name, rows, dim, feats in C.TABLES])
    sparse.load_state_dict(net.sparse.state_dict())
    net.sparse = sparse
    return net


def _fit(dtypes: dict[str, str], epochs: int, ckpt_path=None, callbacks=()):
    lit = C.LitDLRM(_net(dtypes), LR, num_samples=STEPS * WORLD * C.LOCAL_BATCH)
    strategy = TwoDSparseStrategy(**OPTIONS)
    trainer = pl.Trainer(devices=WORLD, strategy=strategy, callbacks=list(callbacks),
                         **{**C.trainer_kwargs(-1), "max_epochs": epochs})
    trainer.fit(lit, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer, lit, strategy


def _worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    out = {}
    saved = f"{root}/saved"
    for run, kwargs in (("saved and went on", dict(callbacks=[K.SaveAtEpochEnd(saved, 1)])),
                        ("resumed", dict(ckpt_path=saved))):
        out[run] = K.snapshot(*_fit(HALF, 2, **kwargs))
    _fit(FULL, 1, callbacks=[K.SaveAtEpochEnd(f"{root}/fp32", 1)])
    for run, dtypes, source in (("fp32 into fp16", HALF, f"{root}/fp32"), ("fp16 into fp32", FULL, saved)):
        trainer, lit, strategy = _fit(dtypes, 1, ckpt_path=source)  # loads, trains no step
        out[run] = K.snapshot(trainer, lit, strategy)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("fp16_checkpoint")
    return root, K.run_ranks(_worker, WORLD, C.free_port(), str(root), timeout=600)


def test_an_fp16_table_saves_as_fp16_with_fp32_state(runs):
    root, _ = runs
    saved = K.read_checkpoint(root / "saved")
    for table in TABLES:
        dtype = torch.float16 if HALF[table.split(".")[3]] == "fp16" else torch.float32
        assert saved[f"state_dict.{table}"].dtype == dtype, table
        assert saved[f"sparse_optimizer.{table}.momentum"].dtype == torch.float32, table
    assert K.read_checkpoint(root / "fp32")[f"state_dict.{TABLES[1]}"].dtype == torch.float32


def test_an_fp16_run_resumes_bit_for_bit(runs):
    _, results = runs
    for rank, result in enumerate(results):
        went_on, resumed = result["saved and went on"], result["resumed"]
        assert resumed["global_step"] == went_on["global_step"] == 2 * STEPS
        for part in ("model", "sparse_states", "dense_optimizer"):
            assert went_on[part].keys() == resumed[part].keys()
            for key, want in went_on[part].items():
                assert resumed[part][key].dtype == want.dtype, (part, key)
                assert (resumed[part][key] == want).all(), f"rank {rank}: {part} {key} differs after the resume"
        assert went_on["model"][TABLES[1]].dtype.name == "float16"


@pytest.mark.parametrize("run, source", [("fp32 into fp16", "fp32"), ("fp16 into fp32", "saved")])
def test_a_checkpoint_loads_across_fp32_and_fp16_tables(runs, run, source):
    root, results = runs
    saved = K.read_checkpoint(root / source)
    for result in results:
        loaded = result[run]
        assert loaded["global_step"] == STEPS and loaded["seen"] == 0, "loaded, not trained"
        for table in TABLES:
            want, got = saved[f"state_dict.{table}"], torch.from_numpy(loaded["model"][table])
            here = HALF[table.split(".")[3]] if run == "fp32 into fp16" else "fp32"
            assert got.dtype == (torch.float16 if here == "fp16" else torch.float32), table
            assert torch.equal(got, want.to(got.dtype)), table  # rounded to nearest, or widened exactly
            if want.dtype != got.dtype and got.dtype == torch.float16:
                assert not torch.equal(got.float(), want), f"{table}: the fp32 rows need rounding"
        momentum = [v for k, v in loaded["sparse_states"].items() if k.endswith("momentum1")]
        assert momentum and all(v.dtype.name == "float32" for v in momentum)


def test_consolidate_gives_fp16_tables_in_fp16(runs):
    root, _ = runs
    saved = K.read_checkpoint(root / "saved")
    state = consolidate(root / "saved")
    assert set(state) == {f"net.{key}" for key in _net(HALF).state_dict()}
    for key, value in state.items():
        assert value.dtype == saved[f"state_dict.{key}"].dtype, key
        assert torch.equal(value, saved[f"state_dict.{key}"]), key
    module = _net(HALF)
    module.load_state_dict({key.removeprefix("net."): value for key, value in state.items()})
    assert module.sparse.embedding_bags["t_item"].weight.dtype == torch.float16
