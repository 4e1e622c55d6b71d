"""Which models build layers at set-up (``planning.builds_at_setup``): those whose ``configure_model``
Lightning calls as overridden (``is_overridden``), whether the class or the instance overrides it."""

from __future__ import annotations

import torch
from torch import nn

from lightning_twod.models.dlrm import DLRM
from lightning_twod.strategies.planning import builds_at_setup


def _model() -> DLRM:
    return DLRM(table_rows=[100, 50], num_dense=3, embedding_dim=8, bottom_mlp=[8], top_mlp=[8])


class LazyDLRM(DLRM):
    def configure_model(self) -> None:
        pass


def test_a_class_that_overrides_configure_model_builds_at_setup():
    assert builds_at_setup(LazyDLRM(table_rows=[100, 50], num_dense=3, embedding_dim=8, bottom_mlp=[8], top_mlp=[8]))
    assert not builds_at_setup(_model())
    assert not builds_at_setup(nn.Linear(2, 2))  # not a LightningModule: no hook to call


def test_a_configure_model_set_on_the_instance_builds_at_setup_as_lightning_calls_it():
    model = _model()
    model.configure_model = lambda: setattr(model, "extra", torch.nn.Linear(2, 2))
    assert builds_at_setup(model)
