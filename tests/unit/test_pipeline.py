"""Input-dist pipelining's parts on one process: the walk over a batch's sparse leaves, batches
compared by content, the lookahead iterator, and the ``pipeline`` option's check (the pipelined fits:
``tests/system/test_pipeline.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_twod import SparseFeatures, TwoDSparseStrategy
from lightning_twod.sparse.pipeline import same_batch, sparse_leaves
from lightning_twod.strategies.lookahead import Lookahead


# ----------------------------------------------------------------------------- one process
def test_sparse_leaves_walks_mappings_sequences_and_dataclasses_in_order():
    from dataclasses import dataclass

    a = SparseFeatures.from_dict({"x": [[1], [2]]})
    b = SparseFeatures.from_dict({"y": [[3], []]})

    @dataclass
    class Batch:
        dense: torch.Tensor
        sparse: SparseFeatures

    batch = ({"first": a, "n": 3, "t": torch.ones(2)}, [Batch(torch.zeros(1), b)], "text")
    assert [id(f) for f in sparse_leaves(batch)] == [id(a), id(b)]
    assert sparse_leaves(torch.ones(3)) == []


def test_same_batch_compares_content():
    a = SparseFeatures.from_dict({"x": [[1, 2], [3]]})
    assert same_batch(a, SparseFeatures.from_dict({"x": [[1, 2], [3]]}))
    assert not same_batch(a, SparseFeatures.from_dict({"x": [[1], [2, 3]]}))
    assert not same_batch(a, SparseFeatures.from_dict({"x": [[1, 2], [4]]}))
    assert not same_batch(a, SparseFeatures.from_dict({"y": [[1, 2], [3]]}))


def test_lookahead_peeks_without_consuming():
    it = Lookahead(iter([1, 2]))
    assert next(it) == 1
    assert it.peek() == 2 and it.peek() == 2
    assert next(it) == 2
    assert it.peek() is None
    with pytest.raises(StopIteration):
        next(it)


def test_pipeline_must_be_a_bool():
    with pytest.raises(ValueError, match="pipeline"):
        TwoDSparseStrategy(pipeline="yes")
