"""Bad sparse input on one process: the unsharded collections raise a ValueError naming the feature
(and table) and the offending value, and leave their weights alone (the sharded meshes:
``tests/system/test_bad_input.py``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_twod.core.features import SparseFeatures
from lightning_twod.distributed import MeshGroups
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.bad_batches import BATCH_SEED, BATCH_SIZES, KINDS, bad_batch
from tests.helpers.sparse_cases import make_module, random_batch


# ---------------------------------------------------------------- one process, unsharded
def _good_batch() -> SparseFeatures:
    return random_batch(sum(BATCH_SIZES), seed=BATCH_SEED).split_batch(BATCH_SIZES)[1]


@pytest.mark.parametrize("pooled", [True, False], ids=["bag", "sequence"])
@pytest.mark.parametrize("kind", KINDS)
def test_unsharded_collection_rejects_bad_input(kind, pooled):
    module = make_module(pooled, seed=1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    bad, expected = bad_batch(_good_batch(), kind)
    with pytest.raises(ValueError) as info:
        module(bad)
    for needle in expected:
        assert needle in str(info.value)
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_single_process_sharded_rejects_bad_input(kind):
    sharded = shard_collection(make_module(True, seed=1), ShardingSpec(MeshGroups.single_process(), backend="torch"))
    before = [w.clone() for _, w in sharded.local_shards()]
    bad, expected = bad_batch(_good_batch(), kind)
    with pytest.raises(ValueError) as info:
        sharded(bad)
    for needle in expected:
        assert needle in str(info.value)
    for old, (_, new) in zip(before, sharded.local_shards(), strict=True):
        assert torch.equal(old, new)


def test_validate_inputs_false_skips_the_check(monkeypatch):
    calls = []
    original = SparseFeatures.validation_error

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SparseFeatures, "validation_error", counting)
    batch = _good_batch()
    for pooled in (True, False):
        module = make_module(pooled, seed=2)
        sharded = shard_collection(module, ShardingSpec(MeshGroups.single_process(), backend="torch"))
        expected = module(batch)
        assert len(calls) == 1  # the unsharded module checks by default
        sharded(batch)
        assert len(calls) == 2  # and so does the sharded one
        module.validate_inputs = False
        sharded.validate_inputs = False
        out, unchecked = sharded(batch), module(batch)
        assert len(calls) == 2, "validate_inputs=False must skip the input check"
        if pooled:
            torch.testing.assert_close(out.values(), expected.values(), atol=1e-6, rtol=0)
            torch.testing.assert_close(unchecked.values(), expected.values(), atol=0, rtol=0)
        else:
            for feature in expected:
                torch.testing.assert_close(out[feature].values, expected[feature].values, atol=1e-6, rtol=0)
        calls.clear()
