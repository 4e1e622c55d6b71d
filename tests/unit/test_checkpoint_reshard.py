"""A checkpoint of an earlier version saved without the momentum scales: a plain row-wise AdaGrad
one is known to have ``c = 1`` (the resharding runs: ``tests/system/test_checkpoint_reshard.py``)."""

from __future__ import annotations

import json


def test_an_earlier_plain_rowwise_adagrad_checkpoint_is_known_to_divide_by_one(tmp_path):
    """Plain row-wise AdaGrad (the earlier default) divides by nothing: its v loads times c here."""
    from lightning_twod.checkpoint.tables import _saved_scales

    layout = {"format": "lightning-twod-checkpoint/2", "sparse_optimizer":
              "SparseOptimizerConfig(name='rowwise_adagrad', lr=0.05, eps=1e-08, momentum_scale=2.0)"}
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    assert _saved_scales(tmp_path) == 1.0
    layout["sparse_optimizer"] = layout["sparse_optimizer"].replace("'rowwise", "'momentum_rowwise")
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    assert _saved_scales(tmp_path) is None  # c of its data-parallel tables is not recorded: unknown
