"""A checkpoint loaded on another mesh or sharding plan than the one that saved it is said so, once,
by rank 0 (``layout.json`` records the saving mesh and plans); on the same mesh and plan, nothing."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
from lightning_utilities.core import rank_zero

from lightning_twod import TwoDSparseStrategy
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C

WORLD = 2
STEPS = 2


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit(group: int, epochs: int, ckpt_path=None, callbacks=(), sharding=None) -> list[str]:
    """One fit on ``WORLD / group`` x ``group``; the lines about resharding it logged."""
    lines = _Lines()
    rank_zero.log.addHandler(lines)  # the logger of Lightning's rank_zero_info
    try:
        lit = C.LitDLRM(C.make_net("collection"), 0.1, num_samples=STEPS * WORLD * C.LOCAL_BATCH)
        strategy = TwoDSparseStrategy(shard_group_size=group, sparse_optimizer="sgd", sharding=sharding)
        trainer = pl.Trainer(devices=WORLD, strategy=strategy, callbacks=list(callbacks),
                             **{**C.trainer_kwargs(-1), "max_epochs": epochs})
        trainer.fit(lit, ckpt_path=ckpt_path)
    finally:
        rank_zero.log.removeHandler(lines)
    return [line for line in lines.lines if "resharded" in line]


def _worker(rank: int, world: int, port: int, root: str) -> dict[str, list[str]]:
    C.as_external_rank(rank, world, port)
    saved = f"{root}/saved_2x1.ckpt"
    _fit(1, 1, callbacks=[K.SaveAtEpochEnd(saved, 1)])
    return {"1x2": _fit(2, 2, saved), "2x1": _fit(1, 2, saved),
            "2x1 row_wise": _fit(1, 2, saved, sharding={"t_user": "row_wise"})}


def test_a_checkpoint_loaded_on_another_mesh_says_so_once(tmp_path):
    ranks = K.run_ranks(_worker, WORLD, C.free_port(), str(tmp_path), timeout=300)
    path = tmp_path / "saved_2x1.ckpt"
    assert ranks[0]["1x2"] == [f"TwoDSparseStrategy: checkpoint {path} was saved on 2x1 (contiguous), loading on "
                               "1x2 (contiguous): resharded (each rank reads its own rows and columns)"]
    assert ranks[0]["2x1 row_wise"] == [f"TwoDSparseStrategy: checkpoint {path} was saved on 2x1 (contiguous) too, "
                                        "with another sharding plan: resharded (each rank reads its own rows and "
                                        "columns)"]
    assert ranks[0]["2x1"] == [], "the same mesh and plan: nothing to say"
    assert all(lines == [] for lines in ranks[1].values()), "rank 0 says it"
