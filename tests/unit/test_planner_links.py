"""Links on one process: the YAML of ``calibrate`` and its errors, presets, repeated probes and their
fastest numbers, and the strategy's ``links=`` (the probe on real processes: ``tests/system/test_planner_links.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.hardware.probe import read_bandwidth
from lightning_twod.planner import PRESETS, CollectiveCost, LinkModel, TableSpec, Workload, choose_layout, resolve_links
from lightning_twod.planner.layout import Outlook, beats
from lightning_twod.planner.links import fastest_of


def _links() -> LinkModel:
    return LinkModel(CollectiveCost(1.2e9, 600e-6), CollectiveCost(0.06e9, 1.1e-3), CollectiveCost(1.25e9, 800e-6),
                     CollectiveCost(0.062e9, 900e-6), 13e9, 40e9, 55e9, 2, overlap_share=0.8, name="testbed",
                     source="a test")


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "links.yaml"
    _links().save(path)
    again = LinkModel.load(path)
    assert again == _links()
    assert resolve_links(str(path)) == again
    assert "bandwidth_gbps: 0.06" in path.read_text() and "latency_us: 1100" in path.read_text()


def _scaled(links: LinkModel, k: float) -> LinkModel:
    """``links`` with every rate ``k`` times as fast and every latency ``k`` times as short."""
    from dataclasses import replace

    def cost(c: CollectiveCost) -> CollectiveCost:
        return CollectiveCost(c.bandwidth * k, c.latency / k)

    return replace(links, all_to_all_intra=cost(links.all_to_all_intra), all_to_all_inter=cost(links.all_to_all_inter),
                   all_reduce_intra=cost(links.all_reduce_intra), all_reduce_inter=cost(links.all_reduce_inter),
                   lookup_bandwidth=links.lookup_bandwidth * k, copy_bandwidth=links.copy_bandwidth * k,
                   dense_flops=links.dense_flops * k)


def test_repeated_probes_round_trip_with_their_fastest(tmp_path):
    probes = [_scaled(_links(), k) for k in (0.5, 1.0, 4.0)]
    fastest = fastest_of(probes, "measured", "three probes")
    assert fastest == _scaled(_links(), 4.0).__class__(**{**vars(_scaled(_links(), 4.0)), "name": "measured",
                                                         "source": "three probes"})
    # one probe slow on one link, another on another: each number is the fastest of the three on its own
    steady = _links()
    mixed = fastest_of([_one_link(steady, "all_to_all_inter", 0.5), _one_link(steady, "all_reduce_intra", 0.5),
                        _one_link(steady, "all_reduce_intra", 0.9)], "measured", "three probes")
    assert mixed == steady.__class__(**{**vars(steady), "name": "measured", "source": "three probes"})
    path = tmp_path / "links.yaml"
    fastest.save(path)
    again = LinkModel.load(path)
    assert again == fastest and len(again.samples) == 3
    assert [s.all_to_all_inter for s in again.samples] == [p.all_to_all_inter for p in probes]


def _one_link(links: LinkModel, kind: str, k: float) -> LinkModel:
    """``links`` with the collective ``kind`` (e.g. ``"all_to_all_inter"``) ``k`` times as fast."""
    from dataclasses import replace

    cost = getattr(links, kind)
    return replace(links, **{kind: CollectiveCost(cost.bandwidth * k, cost.latency / k)})


# Two nodes of two ranks, tables whose all-to-all and reduction cost about the same: the layouts'
# predictions lie a few per cent apart.
_SPECS = {"sparse": [TableSpec(f"t{i}", 200_000, 32, pooling_factor=2) for i in range(4)]}


def _choose(links: LinkModel, placement: str = "auto"):
    return choose_layout(_SPECS, 4, 2, 2**34, Workload(batch_size=256, sync_interval=4), links, placement=placement)


def test_a_busy_host_that_slows_every_probe_does_not_change_the_choice():
    fastest, candidates, _ = _choose(_links())  # one set of numbers: the fastest
    assert fastest is min((c for c in candidates if c.fits), key=lambda c: c.time.total)
    assert candidates.index(fastest) > 0, "the case needs a candidate listed before the fastest"
    # probes of which the slowest took 3x the fastest's time everywhere (the spread of every prediction
    # is far beyond the gaps between them): the layouts compare alike on each probe, so the choice stands
    for ks in ((1 / 3, 0.6, 1.0), (0.999, 1.0, 1.001)):
        best, candidates, line = _choose(fastest_of([_scaled(_links(), k) for k in ks], "measured", "noisy probes"))
        assert (best.group_size, best.placement) == (fastest.group_size, fastest.placement), line
        head = line.splitlines()[0]
        assert "faster on all 3 probes and their fastest numbers" in head
        assert all("(probes " in row for row in line.splitlines()[2:] if "does not fit" not in row)
        assert "close to the choice" not in line


def test_a_candidate_slower_on_some_probes_wins_only_by_the_margin_on_the_fastest_numbers():
    # groups of 4 send their ids across nodes: two probes of three found the all-to-all across nodes slower;
    # groups of 4 are predicted faster on the fastest numbers, slower on those probes
    probes = [_one_link(_links(), "all_to_all_inter", k) for k in (0.9, 0.8, 0.8)]
    best, candidates, line = _choose(fastest_of(probes, "measured", "probes"), placement="contiguous")
    by_size = {c.group_size: c for c in candidates}
    assert by_size[4].time.total < by_size[2].time.total < by_size[1].time.total
    gain = 1 - by_size[4].time.total / by_size[2].time.total
    assert 0 < gain < 0.10  # short of the margin
    assert best is by_size[2], line  # S=2 beats S=1; S=4 does not beat S=2
    head, *rows = line.splitlines()
    assert "kept: S=4 contiguous is predicted" in head and "not faster on probe 2, probe 3;" in head
    assert f"{gain:.0%} faster on the fastest numbers, short of 10%" in head
    close = next(row for row in rows if "close to the choice" in row)
    assert "S=4 contiguous" in close and "S=1" not in close
    # the same gap steady on every probe: S=4 wins
    steady = _one_link(_links(), "all_to_all_inter", 0.9)
    best, _, line = _choose(fastest_of([steady] * 3, "measured", "probes"), placement="contiguous")
    assert best.group_size == 4, line
    # a gap beyond the margin on the fastest numbers wins however many probes were disturbed
    probes = [_one_link(_links(), "all_to_all_inter", k) for k in (4.0, 0.5, 0.5)]
    best, candidates, line = _choose(fastest_of(probes, "measured", "probes"), placement="contiguous")
    by_size = {c.group_size: c for c in candidates}
    assert by_size[4].outlook.probes[1] > by_size[2].outlook.probes[1], "probe 2 must favour S=2"
    assert best is by_size[4] and "faster on the probes' fastest numbers, at least 10%" in line.splitlines()[0], line


@pytest.mark.parametrize("challenger, holder, wins", [
    (Outlook(0.8, (0.8, 0.85, 0.9)), Outlook(0.9, (0.9, 0.95, 1.0)), "faster on all 3 probes"),
    (Outlook(0.5, (0.5, 1.3, 1.2)), Outlook(0.7, (0.7, 0.75, 1.0)), "29% faster on the probes' fastest numbers"),
    (Outlook(0.65, (0.65, 0.7, 0.9)), Outlook(0.7, (0.7, 0.75, 0.85)), ""),  # 7 %, slower on probe 3
    (Outlook(0.98, (0.98, 0.99, 0.97)), Outlook(1.0, (1.0, 1.01, 1.0)), ""),  # faster on every probe, by 2 %
    (Outlook(0.94, (0.94, 0.95, 0.93)), Outlook(1.0, (1.0, 1.01, 1.0)), "faster on all 3 probes"),  # by 6 %
    (Outlook(0.9), Outlook(1.0), "100.0 ms faster"),  # one set of numbers: the faster wins
    (Outlook(1.0), Outlook(1.0), ""),  # a tie keeps the earlier
])
def test_a_layout_beats_another_on_every_probe_or_by_the_margin_on_the_fastest_numbers(challenger, holder, wins):
    reason = beats(challenger, holder)
    assert (wins in reason) if wins else reason == ""


def test_nothing_measured_on_a_cpu_is_not_named_as_a_gpu_preset():
    from lightning_twod.hardware.resolve import planning_links

    on_cpu = planning_links("auto", None, 2, torch.device("cpu"), chosen_by_cost=True)
    assert on_cpu.name not in PRESETS and "not this CPU's" in on_cpu.source
    assert planning_links("auto", None, 2, torch.device("cuda"), chosen_by_cost=True) is PRESETS["h100"]


def test_presets_are_datasheet_numbers_times_their_efficiency():
    h100 = PRESETS["h100"]
    assert h100.all_to_all_inter.bandwidth == pytest.approx(50e9 * 0.7)
    assert h100.all_reduce_intra.bandwidth == pytest.approx(450e9 * 0.8)
    assert h100.node_link_capacity("all_to_all") == pytest.approx(8 * 50e9 * 0.7)
    assert resolve_links("a100-p4d") is PRESETS["a100-p4d"]
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_links("b200")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["all_reduce"]["inter_node"].pop("latency_us"), "missing field all_reduce.inter_node.latency_us"),
    (lambda d: d.pop("compute"), "missing field compute"),
    (lambda d: d["all_to_all"]["intra_node"].update(bandwidth_gbps="fast"),
     "field all_to_all.intra_node.bandwidth_gbps must be a finite number, got 'fast'"),
    (lambda d: d["all_to_all"]["inter_node"].update(bandwidth_gbps=-1), "field all_to_all.inter_node: bandwidth"),
    (lambda d: d["compute"].update(dense_tflops=0), "field compute.dense_tflops must be > 0"),
    (lambda d: d.update(ranks_per_node=1.5), "field ranks_per_node must be an int"),
    (lambda d: d.pop("overlap_share"), "missing field overlap_share"),
    (lambda d: d.update(overlap_share=-0.1), "field overlap_share must be >= 0"),
])
def test_a_bad_links_file_names_the_file_and_the_field(tmp_path, edit, message):
    import yaml

    data = _links().to_container()
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as err:
        LinkModel.load(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_a_missing_or_unreadable_links_file(tmp_path):
    with pytest.raises(ValueError, match=r"links file '.*nope\.yaml' cannot be read: No such file"):
        LinkModel.load(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="cannot be read"):
        LinkModel.load(tmp_path)  # a directory
    (tmp_path / "broken.yaml").write_text("all_to_all: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml' is not valid YAML"):
        LinkModel.load(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="list.yaml': expected a mapping"):
        LinkModel.load(tmp_path / "list.yaml")


def test_the_strategy_reads_links_at_construction(tmp_path):
    path = tmp_path / "links.yaml"
    _links().save(path)
    assert TwoDSparseStrategy(links=str(path)).options.links == _links()
    assert TwoDSparseStrategy(links="a100-p4d").options.links is PRESETS["a100-p4d"]
    assert TwoDSparseStrategy().options.links == "auto"
    assert TwoDSparseStrategy(links="measure").options.links == "measure"
    with pytest.raises(ValueError, match="missing.yaml' cannot be read"):
        TwoDSparseStrategy(links=str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="links=12; use 'auto', 'measure', a preset"):
        TwoDSparseStrategy(links=12)
    with pytest.raises(ValueError, match="placement='diagonal'"):
        TwoDSparseStrategy(placement="diagonal")
    assert TwoDSparseStrategy(placement="auto").options.placement == "auto"


def _probe_out_of_budget(latency: float, bandwidth: float):
    """A probe of two nodes of two whose calls take the time of a link of known ``latency`` (s) and
    ``bandwidth`` (bytes/s), and whose budget is already spent (as where its compute part ran long
    on ranks that share cores)."""
    from lightning_twod.hardware.probe import _Probe

    probe = object.__new__(_Probe)
    probe.rpn, probe.nodes, probe.device, probe.budget, probe.elapsed = 2, 2, torch.device("cpu"), 1.0, 5.0
    probe.timed = lambda kind, across, nbytes, count=3: latency + nbytes / 2 / bandwidth
    return probe


def test_a_probe_out_of_budget_still_reads_the_bandwidth_off_a_large_message():
    measured = _probe_out_of_budget(latency=2e-3, bandwidth=1e9).collective("all_to_all", True, 1.0)
    assert measured.bandwidth == pytest.approx(1e9, rel=0.05)  # not read off the 32 KiB message (60x less)
    assert measured.latency == pytest.approx(2e-3, rel=0.05)


def test_a_token_buckets_burst_does_not_read_as_bandwidth():
    # a link shaped to 62.5 MB/s a rank whose bucket passes its first 0.6 MB at once (the testbed's tbf
    # at 1 Gbit/s, shared by two ranks): a 1 MiB message mostly rides the burst, a 4 MiB one does not
    rate, burst, latency = 62.5e6, 0.6e6, 1e-4

    def call(nbytes):
        return nbytes, latency + max(0.0, nbytes - burst) / rate

    small, before, last = call(128), call(2**20), call(2**22)
    assert (last[0] - small[0]) / (last[1] - small[1]) > 1.15 * rate  # bytes over time: the burst counts
    assert read_bandwidth(small, before, last) == pytest.approx(rate, rel=1e-6)
    # a slow earlier size (a scheduler slice) cannot raise the reading above the plain one
    noisy = read_bandwidth(small, (before[0], last[1] * 0.99), last)
    assert noisy == pytest.approx((last[0] - small[0]) / (last[1] - small[1]))
