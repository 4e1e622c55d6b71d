"""The at-scale simulator: phases, memory, the layout it chooses, efficiency, and the ``simulate`` command."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_twod.cli.simulate import simulate_main
from lightning_twod.planner.hardware import H100
from lightning_twod.planner.inputs import TableSpec
from lightning_twod.planner.simreport import format_table, point_memory
from lightning_twod.planner.simulate import LEAST_MEMORY_ROUND, PRESETS, Scenario, round_label, simulate, with_links
from lightning_twod.planner.storage import RESERVED_BYTES


def _scenario(**changes) -> Scenario:
    tables = tuple(TableSpec(f"t{i}", 2_000_000, 64, pooling_factor=float(1 + i % 5)) for i in range(12))
    return replace(Scenario(tables, batch_size=512, world_sizes=(8, 16, 64)), **changes)


def _points(simulation) -> dict:
    return {(p.layout, p.world_size): p for p in simulation.points}


def test_2d_keeps_all_to_all_on_the_node_and_scales_better_at_scale():
    points = _points(simulate(_scenario(group_size="node", placement="contiguous")))
    one_d, two_d = points["1D", 64], points["2D", 64]
    assert two_d.group_size == 8 and two_d.replicas == 8
    a2a = lambda p: p.time.input_all_to_all + p.time.output_all_to_all  # noqa: E731
    assert a2a(two_d) < a2a(one_d) / 5  # NVLink and 7 peers instead of the network and 63 peers
    assert two_d.time.reduction > 0 and one_d.time.reduction == 0
    assert one_d.imbalance >= two_d.imbalance
    # efficiency is 1 at the smallest world (one node: a group of a node is 1D there) and falls with scale for 1D
    assert ("2D", 8) not in points and points["1D", 8].efficiency == pytest.approx(1.0)
    assert points["1D", 64].efficiency < points["1D", 16].efficiency <= 1.0


def test_the_2d_choice_is_the_fastest_layout_and_interval():
    simulation = simulate(_scenario(sync_intervals=(1, 16)))
    for p in simulation.points:
        if p.layout != "2D":
            continue
        assert p.replicas >= 2 and p.tried > 1
        # no other group size, placement or interval is faster by more than the interval policy allows
        for size in (s for s in (1, 2, 4, 8, 16, 32) if s < p.world_size and p.world_size % s == 0):
            for placement in ("contiguous", "strided"):
                fixed = simulate(_scenario(world_sizes=(p.world_size,), group_size=size, placement=placement,
                                           sync_intervals=(p.interval,)))
                other = _points(fixed).get(("2D", p.world_size))
                if other is not None and other.fits:
                    assert p.step_time <= other.step_time * (1 + 1e-9)


def test_a_longer_interval_is_chosen_when_the_reduction_is_what_costs():
    every_step = _points(simulate(_scenario(sync_intervals=(1,))))["2D", 64]
    free = _points(simulate(_scenario(sync_intervals=(1, 1000))))["2D", 64]
    assert every_step.time.reduction > 0
    assert free.interval == 1000 and free.step_time < every_step.step_time


def test_overlap_and_bf16_cut_the_exposed_reduction():
    # 10 GFLOP of dense work per sample: ~15 ms of compute per step for the transfer to hide under
    base = _scenario(sync_intervals=(4,), group_size=8, placement="contiguous", dense_flops_per_sample=10e9)
    blocking = _points(simulate(base))["2D", 64].time
    bf16 = _points(simulate(replace(base, sync_bytes=2)))["2D", 64].time
    overlapped = _points(simulate(replace(base, sync_overlap=True)))["2D", 64].time
    assert {p.sync_round for p in simulate(replace(base, sync_bytes=2)).points if p.layout == "2D"} == {(False, 2)}
    assert bf16.round_transfer < 0.6 * blocking.round_transfer  # half the payload, the mask unchanged
    assert overlapped.round_transfer == blocking.round_transfer
    # hidden: only the launch and apply traffic of the round is left
    assert overlapped.reduction == pytest.approx(overlapped.round_traffic / 4)
    assert overlapped.reduction < blocking.reduction
    # without dense compute, overlap hides no more of the transfer than the rest of the step lasts
    # (lookups, the all-to-all inside a node): the model does not pretend it does
    idle = _points(simulate(replace(base, dense_flops_per_sample=0.0, sync_overlap=True)))["2D", 64].time
    rest = idle.total - idle.reduction - idle.dense_all_reduce
    assert 4 * idle.reduction >= idle.round_transfer + idle.round_traffic - 4 * rest - 1e-12
    assert idle.reduction > 0.9 * blocking.reduction


def _overlapped_bf16(scenario: Scenario) -> Scenario:
    return replace(scenario, sync_overlap=True, sync_bytes=2)


def _not_slower(blocking: dict, overlapped: dict) -> None:
    """Every layout the blocking fp32 round fits is as fast or faster where the overlapped bf16 one is allowed."""
    for key, point in blocking.items():
        if point.fits and point.layout != "1D":
            other = overlapped[key]
            assert other.fits and other.step_time <= point.step_time * (1 + 1e-9), (key, other.step_time, point.step_time)


def test_a_layout_takes_a_round_with_fewer_buffers_where_the_overlapped_bf16_one_does_not_fit():
    # 5.5 GB GPUs: the blocking fp32 round fits 2D at every size; the overlapped round's snapshot of what it
    # sent and the bf16 wire's reference copy of every replicated shard do not fit those layouts
    blocking = with_links(_scenario(per_table=True), memory_gb=5.5)
    overlapped = _overlapped_bf16(blocking)
    assert blocking.rounds == (LEAST_MEMORY_ROUND,)
    assert overlapped.rounds == ((True, 2), (True, 4), (False, 2), LEAST_MEMORY_ROUND)
    simulation = simulate(overlapped)
    points, before = _points(simulation), _points(simulate(blocking))
    assert all(p.fits for p in before.values() if p.layout == "2D")
    _not_slower(before, points)
    two_d = points["2D", 16]
    assert two_d.sync_round != (True, 2)
    as_asked = point_memory(overlapped, replace(two_d, sync_round=(True, 2)))
    assert as_asked.total + RESERVED_BYTES > 5.5e9 >= two_d.memory
    for p in simulation.points:  # the memory shown is that of the round chosen
        if p.fits and not p.candidate.own_sizes:
            assert point_memory(overlapped, p).total + RESERVED_BYTES == pytest.approx(p.memory)
    table = format_table(overlapped, simulation)
    assert " round " in table and f"{round_label(two_d.sync_round)} " in table
    assert " round " not in format_table(blocking, simulate(replace(blocking, per_table=False)))
    # with memory to spare the scenario's round is kept where it is the fastest
    roomy = _points(simulate(_overlapped_bf16(_scenario())))
    assert roomy["2D", 16].sync_round == (True, 2) and roomy["2D", 16].fits


@pytest.mark.parametrize("interval", [1, 4, 16])
def test_overlapped_bf16_at_each_interval_is_never_below_the_blocking_round_and_its_row_names_the_choice(interval):
    # 5.5 GB GPUs: the overlapped bf16 round fits no 2D layout; each takes the overlapped fp32 or the blocking round
    blocking = with_links(_scenario(sync_intervals=(interval,)), memory_gb=5.5)
    overlapped = _overlapped_bf16(blocking)
    simulation = simulate(overlapped)
    before, after = _points(simulate(blocking)), _points(simulation)
    _not_slower(before, after)
    assert after["1D", 8].efficiency == before["1D", 8].efficiency == 1.0  # the same baseline
    rows = format_table(overlapped, simulation).splitlines()
    for key, point in before.items():
        chosen = after[key]
        assert chosen.efficiency >= point.efficiency * (1 - 1e-9), (key, chosen.efficiency, point.efficiency)
        if key[0] == "2D":
            assert chosen.sync_round != (True, 2) and chosen.interval == interval
            row = f"{chosen.world_size:>5}  2D {chosen.group_size:>5} {chosen.replicas:>4} "
            assert any(line.startswith(row) and f" {round_label(chosen.sync_round)} " in line for line in rows), row


def test_paper_preset_overlapped_bf16_is_never_slower_than_blocking_fp32():
    # the paper stand-in: the bf16 reference copy alone is as large as the replicated shards (56 GB a rank in
    # groups of 128), which the overlapped round's snapshot of whole shards adds to
    paper = PRESETS["paper"]
    # at 4,096 GPUs strided only (the blocking round's choice, 128 x 32 every 16 steps): half the planning
    for worlds, per_table, placement in (((256,), True, "auto"), ((4096,), False, "strided")):
        blocking = replace(paper, world_sizes=worlds, per_table=per_table, placement=placement)
        _not_slower(_points(simulate(blocking)), _points(simulate(_overlapped_bf16(blocking))))


def test_out_of_memory_is_reported():
    # 12 x 2M x (64 + 1) fp32 = 6.2 GB of weights and state; 4.05 GB GPUs keep ~0.5 GB for tables
    small_gpu = with_links(_scenario(), memory_gb=4.05)
    simulation = simulate(small_gpu)
    eight = [p for p in simulation.points if p.world_size == 8]
    assert all(not p.fits for p in eight) and all(p.efficiency is None for p in eight)
    assert all(p.memory > 4.05e9 for p in eight)
    assert any(p.fits for p in simulation.points if p.world_size == 64)
    assert "OOM" in format_table(small_gpu, simulation)


def test_world_sizes_below_a_fixed_group_are_skipped_with_a_note():
    simulation = simulate(_scenario(group_size=16))
    assert ("2D", 8) not in _points(simulation) and ("2D", 16) not in _points(simulation)
    assert _points(simulation)["2D", 64].group_size == 16
    assert any("8 GPUs" in note and "skipped" in note for note in simulation.notes)
    assert "note: 8 GPUs" in format_table(_scenario(group_size=16), simulation)


def test_faster_network_shrinks_1d_all_to_all():
    slow = {p.world_size: p for p in simulate(_scenario()).points if p.layout == "1D"}
    fast = {p.world_size: p for p in simulate(with_links(_scenario(), inter_gbps=400)).points if p.layout == "1D"}
    assert fast[64].time.output_all_to_all < slow[64].time.output_all_to_all
    assert with_links(_scenario(), inter_gbps=400).hardware.inter_node_bandwidth == 400e9
    assert H100.inter_node_bandwidth == 50e9  # the preset itself is untouched


def test_presets_cover_the_published_setups():
    assert {"paper", "pinterest", "mlperf"} <= set(PRESETS)
    assert max(PRESETS["paper"].world_sizes) == 4096 and min(PRESETS["paper"].world_sizes) == 8
    assert PRESETS["pinterest"].world_sizes[-1] == 64  # 8 nodes of 8 GPUs


def test_simulate_command_prints_the_table_and_writes_a_png_only_when_asked(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tables = tmp_path / "tables.yaml"
    tables.write_text("tables:\n"
                      "  - {name: user, rows: 5000000, dim: 64, pooling_factor: 1}\n"
                      "  - {name: item, rows: 20000000, dim: 64, pooling_factor: 20, id_skew: 4, hashed: true}\n")
    assert simulate_main(["--tables", str(tables), "--nodes", "1", "2", "8", "--gpus-per-node", "8",
                          "--inter-bw", "25"]) == 0
    out = capsys.readouterr().out
    assert "scenario tables: 2 tables" in out and "17.5 GB/s per GPU across" in out  # 25 GB/s x 70 %
    rows = [line for line in out.splitlines() if line.strip().startswith(("8 ", "16 ", "64 "))]
    assert len(rows) == 6  # 3 world sizes x (1D, 2D)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tables.yaml"]  # no file without --plot
    png = tmp_path / "sim.png"
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (requirements/cpu.txt)")
    assert simulate_main(["--tables", str(tables), "--nodes", "1", "2", "--plot", str(png)]) == 0
    assert "plot written" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_with_a_group_larger_than_some_worlds_has_no_traceback(capsys):
    assert simulate_main(["--preset", "pinterest", "--group-size", "512"]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped") == 4 and "Traceback" not in out
    with pytest.raises(SystemExit):
        simulate_main(["--group-size", "zero"])
