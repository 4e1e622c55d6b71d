"""The snapshot of a batch sent ahead holds its own tensors on the lookup device, so an edit of the
batch in place is seen (the pipelined fits: ``tests/system/test_pipeline_inplace.py``)."""

from __future__ import annotations

import torch

from lightning_twod import SparseFeatures
from lightning_twod.sparse.pipeline import same_batch, snapshot


def test_a_snapshot_on_the_lookup_device_holds_its_own_tensors():
    features = SparseFeatures.from_dict({"x": [[1, 2], [3]]}, weights={"x": [[0.5, 1.0], [2.0]]})
    taken = snapshot(features, torch.device("cpu"))
    assert same_batch(taken, features)
    features.weights.mul_(2)
    assert not same_batch(taken, features)
    features.weights.div_(2)
    features.values.add_(1)
    assert not same_batch(taken, features)
    assert taken.values.tolist() == [1, 2, 3] and taken.weights.tolist() == [0.5, 1.0, 2.0]
