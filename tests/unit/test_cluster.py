"""The two-node testbed of benchmarks/cluster.py without starting it: link rates and token-bucket sizes,
and the refusal without root (its runs: ``tests/system/test_cluster.py``)."""

from __future__ import annotations

import os

import pytest

from benchmarks import cluster


def test_rates_and_bucket_sizes():
    assert cluster.parse_rate("200mbit") == 200_000_000
    assert cluster.parse_rate("1gbit") == cluster.parse_rate("1e9") == 10**9
    assert cluster.parse_rate("unshaped") is None and cluster.parse_rate(None) is None
    for bad in ("10mbps", "fast", "1kbit"):
        with pytest.raises(ValueError, match="rate"):
            cluster.parse_rate(bad)
    assert cluster.tbf_burst(10**9) == 10**9 // 800  # 10 ms of traffic
    assert cluster.tbf_burst(10**6) == 64 * 1024  # one GSO packet at least
    assert cluster.format_rate(10**9) == "1 Gbit/s" and cluster.format_rate(None) == "unshaped"


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.TestbedUnavailable, match="needs root"):
        cluster.preflight()
    with pytest.raises(cluster.TestbedUnavailable, match="needs root"), cluster.two_nodes():
        pytest.fail("the body must not run")
