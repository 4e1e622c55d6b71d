"""The two-node testbed of benchmarks/testbed.py without starting it: link rates and token-bucket sizes,
and the refusal without root (its runs: ``tests/system/test_cluster.py``)."""

from __future__ import annotations

import os

import pytest

from benchmarks import testbed


def test_rates_and_bucket_sizes():
    assert testbed.parse_rate("200mbit") == 200_000_000
    assert testbed.parse_rate("1gbit") == testbed.parse_rate("1e9") == 10**9
    assert testbed.parse_rate("unshaped") is None and testbed.parse_rate(None) is None
    for bad in ("10mbps", "fast", "1kbit"):
        with pytest.raises(ValueError, match="rate"):
            testbed.parse_rate(bad)
    assert testbed.tbf_burst(10**9) == 10**9 // 800  # 10 ms of traffic
    assert testbed.tbf_burst(10**6) == 64 * 1024  # one GSO packet at least
    assert testbed.format_rate(10**9) == "1 Gbit/s" and testbed.format_rate(None) == "unshaped"


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(testbed.TestbedUnavailable, match="needs root"):
        testbed.preflight()
    with pytest.raises(testbed.TestbedUnavailable, match="needs root"), testbed.two_nodes():
        pytest.fail("the body must not run")
