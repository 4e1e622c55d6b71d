"""The probe's overlap share from its timed pairs (``hardware.probe.share_of_pairs``), on pairs
recorded on the two-node testbed (4 ranks on 2 cores, 1 Gbit/s, an all-reduce charged 40.3 ms)."""

from __future__ import annotations

import pytest

from lightning_twod.hardware.probe import OVERLAP_REPEATS, share_of_pairs

#: (MLP alone, MLP beside the all-reduce) in ms, in the order they ran; in the fourth pair the MLP
#: alone had a core to itself for part of its run (the other ranks' MLPs started late).
RECORDED = [(207.4, 209.4), (193.1, 185.7), (169.8, 188.7), (120.0, 179.7), (187.1, 210.2)]
CHARGED = 0.0403


def test_a_run_alone_on_a_core_does_not_make_the_share_large():
    pairs = [(a / 1e3, b / 1e3) for a, b in RECORDED]
    assert len(pairs) == OVERLAP_REPEATS
    fastest_of_each = (min(b for _, b in pairs) - min(a for a, _ in pairs)) / CHARGED
    assert fastest_of_each > 1.4  # over the share at which the testbed's plans turn from 2D to 1D (about 0.85)
    assert share_of_pairs(pairs, CHARGED) == pytest.approx(0.0189 / CHARGED)


def test_the_share_is_never_negative():
    assert share_of_pairs([(0.2, 0.1), (0.2, 0.19), (0.2, 0.21)], 0.05) == 0.0
