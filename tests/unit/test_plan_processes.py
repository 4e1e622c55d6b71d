"""``lightning-twod plan`` with links given (a file or a preset) starts no process, whatever the
layout (the unit tier fails a test that starts one). Where ``fit`` measures the links, ``plan``
measures them on processes it starts, and says so first: ``tests/system/test_cli.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_twod.cli.plan import plan_main
from lightning_twod.planner import PRESETS
from tests.helpers.cli_cases import write_config

BY_COST = ["--trainer.strategy.init_args.links=auto", "--trainer.strategy.init_args.shard_group_size=auto"]


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path)


def test_links_given_as_a_file_or_a_preset_start_no_process(config, tmp_path, capsys):
    links = tmp_path / "links.yaml"
    replace(PRESETS["h100"], name="calibrated").save(links)
    for given in (str(links), "h100"):
        assert plan_main(["--config", str(config), *BY_COST, "--links", given]) == 0
        text = capsys.readouterr().out
        assert "shard_group_size=" in text and "measuring the links" not in text and "measured here" not in text

