"""``verify_replicas`` on one process: the digest tells a copy moved by one ulp and swapped rows apart,
and the option's values are checked (the fits that must catch a diverged copy:
``tests/system/test_verify_replicas.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.replication.verify import digest
from tests.helpers.replication_cases import nudge


def test_digest_tells_one_ulp_and_swapped_rows_apart():
    weights = torch.randn(50, 8)
    base = digest(weights)
    assert torch.equal(digest(weights.clone()), base)
    nudged = weights.clone()
    nudge(nudged)
    assert not torch.equal(digest(nudged), base)
    swapped = weights[[1, 0, *range(2, 50)]]
    assert not torch.equal(digest(swapped), base), "rows swapped between positions"
    assert digest(torch.rand(50)).shape == (2,), "row-wise state [R]"


def test_verify_replicas_option_is_checked():
    for bad in ("always", 0, -2, True, 1.5):
        with pytest.raises(ValueError, match="verify_replicas"):
            TwoDSparseStrategy(verify_replicas=bad)
    assert TwoDSparseStrategy(verify_replicas=None).options.verify_replicas == "off"
    assert TwoDSparseStrategy().options.verify_replicas == "checkpoint"
