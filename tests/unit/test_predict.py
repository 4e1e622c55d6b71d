"""The evaluation sampler gives every sample once and every rank the same batches (``test`` and
``predict`` on 4 processes: ``tests/system/test_predict.py``)."""

from __future__ import annotations

from lightning_twod.datasets.sharding import EvalShardSampler
from tests.helpers import strategy_cases as C

NUM_TEST, BATCH = 193, 16  # rank 0 gets 49 samples (4 batches), ranks 1-3 48: each gets one padding sample


def test_the_sampler_gives_every_sample_once_and_every_rank_the_same_batches():
    dataset = list(range(NUM_TEST))
    shares = [list(EvalShardSampler(dataset, C.WORLD, r, BATCH)) for r in range(C.WORLD)]
    assert sorted(i for s in shares for i in s if i >= 0) == dataset
    assert [s.count(-1) for s in shares] == [0, 1, 1, 1], "48 samples end a batch before 49 do"
    assert {-(-len(s) // BATCH) for s in shares} == {4}
