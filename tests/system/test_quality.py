"""The quality benchmark in brief (one seed, a few steps): every configuration trains, and the
configurations that are equal by construction give equal metrics."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from benchmarks import quality

# find_spec, not importorskip: the MovieLens reader must never import recbole (test_movielens checks)
pytestmark = pytest.mark.skipif(find_spec("recbole") is None,
                                reason="MovieLens-100K comes from the recbole==1.2.1 wheel (./test.sh installs it)")

STEPS = 25


@pytest.fixture(scope="module")
def runs() -> dict:
    train, val = quality.load_data()
    return {c.name: quality.train_one(c, 0.05, seed=0, epochs=1, train=train, val=val, evals_per_epoch=0,
                                      max_steps=STEPS)
            for c in quality.CONFIGS}


def test_every_configuration_trains(runs):
    for name, run in runs.items():
        assert run["steps"] == STEPS
        assert run["last_loss"] < run["first_loss"], f"{name}: loss did not go down"
        assert 0.55 < run["auc"] < 1.0, f"{name}: validation AUC {run['auc']:.3f}"


def test_gradient_sync_2d_equals_1d(runs):
    # sync_mode="gradients" is 1D's arithmetic on a 2D layout
    for metric in ("auc", "ne", "logloss"):
        assert runs["2d_gradients"][metric] == pytest.approx(runs["1d"][metric], abs=1e-5)
    # and the layouts that differ do differ: the comparison can fail
    assert runs["w8_m8"]["ne"] != pytest.approx(runs["w8_1d"]["ne"], abs=1e-5)
