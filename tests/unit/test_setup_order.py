"""``TwoDSparseStrategy.setup`` refuses a run it cannot train (precision, gradient clipping) before it
plans the tables: the plan may measure the links, which a refused run should not wait for."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_twod import TwoDSparseStrategy
from lightning_twod.models.dlrm import DLRM


@pytest.fixture(autouse=True)
def _no_group_left():
    """The Trainer's set-up makes a process group of one before the refusal: later tests expect none."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("trainer_kwargs", "match"), [
    (dict(gradient_clip_val=1.0), "remove gradient_clip_val"),
    (dict(precision="64-true"), "precision='64-true' is not supported"),
])
def test_a_refused_run_is_refused_before_the_plan(monkeypatch, trainer_kwargs, match):
    planned = []
    monkeypatch.setattr(TwoDSparseStrategy, "_plan_mesh", lambda self, model: planned.append(model))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=TwoDSparseStrategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    model = DLRM(table_rows=[100, 50], num_dense=3, embedding_dim=8, bottom_mlp=[8], top_mlp=[8])
    with pytest.raises(MisconfigurationException, match=match):
        trainer.fit(model, DataLoader(range(4)))
    assert planned == [], "setup planned the tables of a run it refuses"
