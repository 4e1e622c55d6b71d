"""``lightning_twod.checkpoint.load_from_checkpoint`` on a checkpoint directory (the committed format 1
one, ``K.FORMAT1``), on one process: the module is built from the hyper-parameters and ``kwargs`` and
gets the consolidated state dict as it is read, without a serialized copy of the checkpoint."""

from __future__ import annotations

import pytest
import torch

from lightning_twod.checkpoint import consolidate, load_from_checkpoint
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C


def test_a_directory_loads_into_the_module_without_a_serialized_copy(monkeypatch):
    expected = consolidate(K.FORMAT1)

    def no_copy(*args, **kwargs):
        raise AssertionError("load_from_checkpoint serialized the checkpoint (a third copy of the model)")

    monkeypatch.setattr(torch, "save", no_copy)
    model = load_from_checkpoint(K.AdamDLRM, K.FORMAT1, net=C.make_net("collection"), lr=0.25)
    assert isinstance(model, K.AdamDLRM) and model.lr == 0.25  # kwargs reach the constructor
    state = model.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_strict_loading_is_lightnings():
    class Wider(K.AdamDLRM):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.extra = torch.nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match="Missing key"):
        load_from_checkpoint(Wider, K.FORMAT1, net=C.make_net("collection"), lr=0.25)
    model = load_from_checkpoint(Wider, K.FORMAT1, strict=False, net=C.make_net("collection"), lr=0.25)
    assert torch.equal(model.state_dict()[K.TABLE_KEYS[0]], consolidate(K.FORMAT1)[K.TABLE_KEYS[0]])
