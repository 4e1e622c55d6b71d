"""The at-scale simulator: phases, memory, efficiency, and the ``simulate`` command."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_twod.planner.commands import simulate_main
from lightning_twod.planner.cost import H100, TableSpec
from lightning_twod.planner.simulate import PRESETS, Scenario, format_table, simulate, with_links


def _scenario(**changes) -> Scenario:
    tables = tuple(TableSpec(f"t{i}", 2_000_000, 64, pooling_factor=float(1 + i % 5)) for i in range(12))
    return replace(Scenario(tables, batch_size=512, world_sizes=(8, 16, 64)), **changes)


def test_2d_keeps_all_to_all_on_the_node_and_scales_better_at_scale():
    points = {(p.layout, p.world_size): p for p in simulate(_scenario(group_size="node"))}
    one_d, two_d = points["1D", 64], points["2D", 64]
    assert two_d.group_size == 8 and two_d.replicas == 8
    a2a = lambda p: p.breakdown.input_all_to_all + p.breakdown.output_all_to_all  # noqa: E731
    assert a2a(two_d) < a2a(one_d) / 5  # NVLink and 7 peers instead of the network and 63 peers
    assert two_d.breakdown.cross_group_reduction > 0 and one_d.breakdown.cross_group_reduction == 0
    assert one_d.imbalance >= two_d.imbalance
    # efficiency is 1 for the faster layout at the smallest world and falls with scale for 1D
    assert max(points["1D", 8].efficiency, points["2D", 8].efficiency) == pytest.approx(1.0)
    assert points["1D", 64].efficiency < points["1D", 16].efficiency <= 1.0


def test_out_of_memory_is_reported():
    # 12 x 2M x (64 + 1) fp32 = 6.2 GB of weights and state; 4.05 GB GPUs keep ~0.5 GB for tables
    small_gpu = with_links(_scenario(), memory_gb=4.05)
    points = simulate(small_gpu)
    eight = [p for p in points if p.world_size == 8]
    assert all(not p.fits for p in eight) and all(p.efficiency is None for p in eight)
    assert all(p.memory > 4.05e9 for p in eight)
    assert any(p.fits for p in points if p.world_size == 64)
    assert "OOM" in format_table(small_gpu, points)


def test_auto_group_grows_with_the_model():
    light = {p.world_size: p.group_size for p in simulate(_scenario()) if p.layout == "2D"}
    heavy = {p.world_size: p.group_size for p in simulate(with_links(_scenario(), memory_gb=9)) if p.layout == "2D"}
    assert light[64] == 1  # the tables fit one GPU: full replication
    assert heavy[64] > light[64]


def test_faster_network_shrinks_1d_all_to_all():
    slow = {p.world_size: p for p in simulate(_scenario()) if p.layout == "1D"}
    fast = {p.world_size: p for p in simulate(with_links(_scenario(), inter_gbps=400)) if p.layout == "1D"}
    assert fast[64].breakdown.input_all_to_all < slow[64].breakdown.input_all_to_all
    assert with_links(_scenario(), inter_gbps=400).hardware.inter_node_bandwidth == 400e9
    assert H100.inter_node_bandwidth == 50e9  # the preset itself is untouched


def test_presets_cover_the_published_setups():
    assert {"paper", "pinterest", "mlperf"} <= set(PRESETS)
    assert max(PRESETS["paper"].world_sizes) == 4096 and min(PRESETS["paper"].world_sizes) == 8
    assert PRESETS["pinterest"].world_sizes[-1] == 64  # 8 nodes of 8 GPUs


def test_simulate_command_prints_table_and_writes_png(capsys, tmp_path):
    tables = tmp_path / "tables.yaml"
    tables.write_text("tables:\n"
                      "  - {name: user, rows: 5000000, dim: 64, pooling_factor: 1}\n"
                      "  - {name: item, rows: 20000000, dim: 64, pooling_factor: 20, id_skew: 4, hashed: true}\n")
    png = tmp_path / "sim.png"
    assert simulate_main(["--tables", str(tables), "--nodes", "1", "2", "8", "--gpus-per-node", "8",
                          "--inter-bw", "25", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "scenario tables: 2 tables" in out and "network 25.00 GB/s" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("8 ", "16 ", "64 "))]
    assert len(rows) == 6  # 3 world sizes x (1D, 2D)
    if "plot written" in out:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        pytest.importorskip("matplotlib")
