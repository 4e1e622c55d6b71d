"""Sharded collections on one process: a 1x1 layout without a process group equals the unsharded
module, and the kernels follow the training flag set directly (the meshes: ``tests/system/test_sharded.py``)."""

from __future__ import annotations

import torch

from lightning_twod.distributed import MeshGroups
from lightning_twod.replication.touched import TouchedRows
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.sparse_cases import make_module, random_batch

ATOL = 1e-5


def test_single_process_1x1_without_process_group():
    for pooled in (True, False):
        reference = make_module(pooled, seed=5)
        batch = random_batch(6, seed=2)
        sharded = shard_collection(reference, ShardingSpec(MeshGroups.single_process(), backend="torch"))
        out, expected = sharded(batch), reference(batch)
        if pooled:
            torch.testing.assert_close(out.values(), expected.values(), atol=ATOL, rtol=0)
        else:
            for feature in expected:
                torch.testing.assert_close(out[feature].values, expected[feature].values, atol=ATOL, rtol=0)


def test_kernels_follow_the_training_flag_set_directly():
    """Lightning restores train mode after validation by setting ``module.training`` on every
    submodule (not ``train()``); the kernels must still record the rows a training step touches,
    or the cross-group reduction would average nothing."""
    sharded = shard_collection(make_module(True, seed=1), ShardingSpec(MeshGroups.single_process(), backend="torch"))
    rows = [TouchedRows(k) for k in sharded.kernels()]
    batch = random_batch(4, seed=3)
    sharded.eval()
    with torch.no_grad():
        sharded(batch)
    assert not any(r.take().any() for r in rows)
    assert not any(k.training for k in sharded.kernels())  # a lookup passes eval mode on
    sharded.training = True  # what Lightning's mode restore does
    sharded(batch).values().sum().backward()
    assert sum(int(r.take().sum()) for r in rows) > 0
