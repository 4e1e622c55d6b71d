"""``lightning-twod plan`` reads the links cache entry ``fit`` will read: with one there it starts no
process (the unit tier fails a test that starts one) and plans on the entry's numbers; ``--links
measure`` asks for a new measurement. Measuring where there is none: ``tests/system/test_cli.py``."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from lightning_twod.cli.plan import plan_main
from lightning_twod.planner import PRESETS
from lightning_twod.planner import link_cache as cache
from lightning_twod.planner.link_cache import CacheKey
from lightning_twod.planner.links import fastest_of
from tests.helpers.cli_cases import write_config

BY_COST = ["--trainer.strategy.init_args.links=auto", "--trainer.strategy.init_args.shard_group_size=auto"]


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path)


def _probed():
    """Three probes of a CPU host, as a set-up keeps them (the names a measurement gives)."""
    base = replace(PRESETS["h100"], ranks_per_node=2)
    return fastest_of([base, replace(base, dense_flops=base.dense_flops / 2)], "measured", "measured on 2 ranks")


def test_plan_reads_the_entry_fit_reads_and_starts_no_process(config, capsys):
    path = cache.save(CacheKey((socket.gethostname(),), 2, 2, "cpu"), _probed())  # this machine, 2 ranks
    assert plan_main(["--config", str(config), *BY_COST]) == 0
    text = capsys.readouterr().out
    assert "measuring the links" not in text
    note = text.splitlines()[0]
    assert note.startswith(f"note: links from the links cache {path}, measured") and "fit plans on the same" in note
    assert "links: measured (measured on 2 ranks; from the links cache" in text


def test_plan_on_an_entry_of_other_hosts_or_a_stale_one_would_measure(config, monkeypatch, capsys):
    started = []
    monkeypatch.setattr("lightning_twod.cli.plan.measure_here", lambda *args: started.append(args) or _probed())
    cache.save(CacheKey(("another-host",), 2, 2, "cpu"), _probed())
    cache.save(CacheKey((socket.gethostname(),), 2, 2, "cpu"), _probed(), now=0.0)  # measured in 1970
    assert plan_main(["--config", str(config), *BY_COST]) == 0
    text = capsys.readouterr().out
    assert started == [(2, "cpu", 2)] and "more than 7.0 days" in text.splitlines()[0]
    assert "kept in the links cache" in text  # and fit, next, reads what plan measured
    assert cache.load(CacheKey((socket.gethostname(),), 2, 2, "cpu")).links is not None
    assert plan_main(["--config", str(config), *BY_COST, "--links", "measure"]) == 0
    assert len(started) == 2 and "as --links measure asks" in capsys.readouterr().out
