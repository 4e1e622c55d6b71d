"""A ``sharding`` entry for a table the model does not have fails at ``trainer.fit`` in the launching
process, with set-up's message, before any worker starts (the unit tier fails a test that starts
one); a model that builds layers in ``configure_model`` is checked at set-up only."""

from __future__ import annotations

import os
import re

import lightning.pytorch as pl
import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod.models.dlrm import DLRM
from lightning_twod.strategies.launcher import TwoDMultiProcessingLauncher, TwoDSubprocessScriptLauncher
from lightning_twod.strategies.strategy import TwoDSparseStrategy

MESSAGE = ("TwoDSparseStrategy: sharding names unknown tables ['nope']; "
           "the model's tables are ['t_cat_0', 't_cat_1']")


def _model() -> DLRM:
    return DLRM(table_rows=[100, 50], num_dense=3, embedding_dim=8, bottom_mlp=[8], top_mlp=[8])


class LazyDLRM(DLRM):
    """Lightning's hook for building layers at set-up: tables built there are unknown before launch."""

    def configure_model(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _launched_here():
    """An earlier in-process fit leaves Lightning's launch variables set, with which the Trainer would
    take this process for one of 4 started outside and launch nothing; a launch sets them here."""
    saved = dict(os.environ)
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _trainer(start_method: str) -> pl.Trainer:
    strategy = TwoDSparseStrategy(shard_group_size=2, links="h100", start_method=start_method,
                                  sharding={"t_cat_0": "row_wise", "nope": "row_wise"})
    return pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, max_steps=1)


def test_an_unknown_table_fails_at_fit_before_any_process_starts():
    trainer = _trainer("popen")
    assert isinstance(trainer.strategy.launcher, TwoDSubprocessScriptLauncher)  # it would start 3 processes
    with pytest.raises(MisconfigurationException, match=f"^{re.escape(MESSAGE)}$"):
        trainer.fit(_model())
    # set-up's own check (what every worker would raise) says the same
    with pytest.raises(MisconfigurationException, match=f"^{re.escape(MESSAGE)}$"):
        trainer.strategy.plan_layout(_model(), budget=2**30, links="h100")


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_the_multiprocessing_launcher_checks_first_too(start_method):
    trainer = _trainer(start_method)
    trainer.strategy.connect(_model())  # what trainer.fit does before it launches
    assert isinstance(trainer.strategy.launcher, TwoDMultiProcessingLauncher)
    with pytest.raises(MisconfigurationException, match=f"^{re.escape(MESSAGE)}$"):
        trainer.strategy.launcher.launch(print, trainer=trainer)


def test_known_tables_pass_the_check():
    strategy = TwoDSparseStrategy(shard_group_size=2, sharding={"t_cat_1": "data_parallel"})
    pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    strategy.check_before_launch(_model())  # no error: the launch goes on


def test_a_model_that_builds_tables_in_configure_model_is_checked_at_set_up_only():
    trainer = _trainer("popen")
    assert isinstance(trainer.strategy.launcher, TwoDSubprocessScriptLauncher)
    with pytest.raises(RuntimeError, match="a unit test started a process"):  # launched: no early verdict
        trainer.fit(LazyDLRM(table_rows=[100, 50], num_dense=3, embedding_dim=8, bottom_mlp=[8],
                                       top_mlp=[8]))
