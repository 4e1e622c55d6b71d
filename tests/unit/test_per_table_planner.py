"""Per-table shard group sizes in the planner: the option, the plan's YAML, the search and its errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_twod.core.shards import ShardingType, TableChoice, parse_table_choice
from lightning_twod.planner import (
    CollectiveCost,
    DenseModel,
    LinkModel,
    PlanRequest,
    ShardingPlan,
    Workload,
    plan_for_strategy,
)
from lightning_twod.planner.inputs import GIB, TableSpec
from lightning_twod.planner.layout import Outlook, specs_from_configs
from lightning_twod.planner.links import fastest_of, resolve_links
from lightning_twod.planner.partition import PlanError
from lightning_twod.planner.per_table import EXACT_LIMIT, MAX_PASSES, PerTableSearch
from lightning_twod.planner.simulate import PRESETS, Scenario, simulate

# one table too large to hold twice in a 20 GiB budget of 16 ranks (8 per node), twelve small ones
SKEWED = {"sparse": [("big", 60_000_000, 128)] + [(f"s{i}", 100_000, 128) for i in range(12)]}


def request(shard_group_size="auto", constraints=None, budget_gib=20.0, world=16, links="h100", **kwargs) -> PlanRequest:
    return PlanRequest(world, 8, budget_gib * GIB, Workload(batch_size=2048), shard_group_size=shard_group_size,
                       placement="contiguous", constraints=constraints, links=links, **kwargs)


@pytest.mark.parametrize("entry, want", [
    ("row_wise", TableChoice(ShardingType.ROW_WISE)),
    ({"shard_group_size": 8}, TableChoice(None, 8)),
    ({"type": "table_wise", "shard_group_size": 2}, TableChoice(ShardingType.TABLE_WISE, 2)),
])
def test_a_sharding_entry_gives_a_type_a_group_size_or_both(entry, want):
    assert parse_table_choice(entry, "item") == want


@pytest.mark.parametrize("entry, match", [
    ({"size": 8}, "use a type .* or a mapping"),
    ({"shard_group_size": 0}, "shard_group_size=0"),
    ({"shard_group_size": True}, "shard_group_size=True"),
    ({"type": "data_parallel", "shard_group_size": 4}, "data_parallel keeps a copy on every rank"),
    ({"type": "diagonal"}, "unknown sharding 'diagonal'"),
])
def test_a_bad_sharding_entry_names_the_table_and_the_accepted_forms(entry, match):
    with pytest.raises(ValueError, match=f"table 'item'.*{match}"):
        parse_table_choice(entry, "item")


def test_a_pinned_group_size_is_honoured_and_round_trips_through_yaml():
    planned = plan_for_strategy(SKEWED, request(2, {"big": {"type": "row_wise", "shard_group_size": 8}}))
    plan = planned.plan
    assert plan.shard_group_size == 2 and plan.per_table and plan.group_sizes() == [2, 8]
    big = plan.modules["sparse"]["big"]
    assert big.group_size == 8 and big.sharding_type == ShardingType.ROW_WISE
    assert sorted(shard.owner for shard in big.shards) == list(range(8))
    assert all(ts.group_size is None for name, ts in plan.modules["sparse"].items() if name != "big")
    assert "tables in groups of their own size: big: 8" in planned.explanation
    again = ShardingPlan.from_yaml(plan.to_yaml())
    assert again.modules == plan.modules and again.shard_group_size == 2
    # and a pinned plan with per-table sizes is taken as it is
    pinned = plan_for_strategy(SKEWED, request("auto", pinned=again))
    assert pinned.plan.modules == plan.modules and "from the pinned plan" in pinned.explanation


def test_sizes_that_do_not_divide_the_world_are_refused_naming_the_table_and_the_choices():
    with pytest.raises(ValueError, match=r"table 'big': shard_group_size=3 does not divide world_size=16; "
                                         r"choose one of 1, 2, 4, 8, 16"):
        plan_for_strategy(SKEWED, request(2, {"big": {"shard_group_size": 3}}))
    plan = plan_for_strategy(SKEWED, request(2, {"big": {"shard_group_size": 8}})).plan
    text = plan.to_yaml().replace("shard_group_size: 8", "shard_group_size: 6")
    with pytest.raises(ValueError, match=r"table 'big' of 'sparse': shard_group_size=6 does not divide world_size=16"):
        ShardingPlan.from_yaml(text)


def test_a_table_that_does_not_fit_its_own_group_is_named_with_the_options():
    with pytest.raises(PlanError, match=r"S=4 contiguous, big: 1: tables \['big'\] in groups of 1: .*table 'big' "
                                        r".*does not fit a shard group of 1.*Options: other shard group sizes"):
        plan_for_strategy(SKEWED, request(4, {"big": {"shard_group_size": 1}}))


def test_auto_gives_the_large_table_its_own_group_when_that_is_faster():
    planned = plan_for_strategy(SKEWED, request())
    plan, text = planned.plan, planned.explanation
    assert plan.per_table, text
    big = plan.modules["sparse"]["big"].size_in(plan.shard_group_size)
    small = {ts.size_in(plan.shard_group_size) for name, ts in plan.modules["sparse"].items() if name != "big"}
    assert small != {big}, text
    assert "each table its own group size" in text and "below the best global layout" in text
    # per table: its type, its group and the predicted step with it elsewhere
    line = next(line for line in text.splitlines() if line.strip().startswith("big "))
    assert "row_wise" in line and "1: no fit" in line


def test_auto_keeps_the_global_layout_where_no_table_gains():
    planned = plan_for_strategy({"sparse": [("a", 1000, 16), ("b", 1000, 16)]}, request(world=4, budget_gib=1.0))
    assert not planned.plan.per_table
    assert "per table (searched" in planned.explanation and "every one" in planned.explanation


def test_a_per_table_gain_stands_on_the_fastest_numbers_and_falls_when_every_probe_finds_the_link_slow():
    h100 = resolve_links("h100")

    def probes(*factors):  # the big table in groups of 8 is reduced across nodes: that link k times as fast
        return fastest_of([replace(h100, all_reduce_inter=replace(h100.all_reduce_inter,
                                                                  bandwidth=h100.all_reduce_inter.bandwidth * f))
                           for f in factors], "noisy", "three probes that disagree")

    steady = plan_for_strategy(SKEWED, request(links=h100))
    assert steady.plan.per_table, steady.explanation  # on one set of numbers the per-table layout wins
    # one or two probes of three found that link 5x slower: a busy host only adds time, the fastest stands
    for disturbed in (probes(1.0, 0.2, 1.0), probes(1.0, 0.2, 0.2)):
        planned = plan_for_strategy(SKEWED, request(links=disturbed))
        assert planned.plan.per_table, planned.explanation
        first = planned.explanation.splitlines()[0]
        assert "at least 10%" in first or "faster on all 3 probes and their fastest numbers" in first, first
    planned = plan_for_strategy(SKEWED, request(links=probes(0.2, 0.2, 0.2)))  # every probe: the link is slow
    assert not planned.plan.per_table, planned.explanation
    assert planned.plan.shard_group_size == 16


# The skewed model of the two-node testbed (benchmarks/per_table.py): one 4 M-row table and 26 of 100 k,
# 1.75 GiB a rank, a reduction every 8 steps, overlapped, bf16; 4 ranks, 2 per node.
TESTBED_SKEWED = {"sparse": [("t_cat_0", 4_000_000, 64)] + [(f"t_cat_{i}", 100_000, 64) for i in range(1, 27)]}
TESTBED_1GBIT = LinkModel(  # `calibrate` on the testbed at 1 Gbit/s, 10 s budget (docs/planner.md)
    CollectiveCost(1.2e9, 647e-6), CollectiveCost(0.0578e9, 1.28e-3), CollectiveCost(1.17e9, 880e-6),
    CollectiveCost(0.068e9, 1.0e-3), 6.47e9, 12.9e9, 50e9, 2, overlap_share=0.11, name="testbed-1gbit")


def _busy(links: LinkModel, across: float, rest: float) -> LinkModel:
    """A probe on a busy host: the links across nodes ``across`` times as fast, everything else ``rest``."""
    def cost(c: CollectiveCost, k: float) -> CollectiveCost:
        return CollectiveCost(c.bandwidth * k, c.latency / k)

    return replace(links, all_to_all_inter=cost(links.all_to_all_inter, across),
                   all_reduce_inter=cost(links.all_reduce_inter, across),
                   all_to_all_intra=cost(links.all_to_all_intra, rest), all_reduce_intra=cost(links.all_reduce_intra, rest),
                   lookup_bandwidth=links.lookup_bandwidth * rest, copy_bandwidth=links.copy_bandwidth * rest,
                   dense_flops=links.dense_flops * rest)


def test_noisy_probes_of_a_busy_host_keep_the_per_table_layout_that_the_spread_used_to_veto():
    probes = [_busy(TESTBED_1GBIT, 0.85, 0.9), _busy(TESTBED_1GBIT, 0.55, 0.8), _busy(TESTBED_1GBIT, 0.7, 0.6)]
    noisy = fastest_of(probes, "measured", "three probes on a busy host")
    workload = Workload(batch_size=4096, optimizer="rowwise_adagrad", sync_interval=8, sync_bytes=2, sync_overlap=True)
    planned = plan_for_strategy(TESTBED_SKEWED, PlanRequest(4, 2, 1.75 * GIB, workload, placement="contiguous",
                                                            links=noisy, dense=DenseModel(20_000)))
    assert planned.plan.per_table, planned.explanation
    assert planned.plan.modules["sparse"]["t_cat_0"].size_in(planned.plan.shard_group_size) == 4
    assert planned.plan.shard_group_size == 2
    head = planned.explanation.splitlines()[0]
    assert "each table its own group size" in head and "below the best global layout S=4 contiguous" in head
    assert "faster on all 3 probes and their fastest numbers" in head
    # what the spread rule made of the same numbers: the gain lies within the probes' spread, 1D stayed
    search = PerTableSearch(specs_from_configs(TESTBED_SKEWED), 4, "contiguous", 2, 1.75 * GIB, workload, noisy,
                            DenseModel(20_000))
    one_d = search.evaluate(dict.fromkeys(search.tables, 4))
    per_table = search.evaluate({**dict.fromkeys(search.tables, 2), "t_cat_0": 4})
    spreads = [max(totals) - min(totals) for totals in
               (Outlook.of(lambda on, a=a: search.total_on(a, on), noisy).totals for a in (one_d, per_table))]
    assert 0 < one_d.time.total - per_table.time.total < max(spreads)


def test_the_search_is_exact_when_small_and_bounded_when_large():
    specs = {"m": [TableSpec(f"t{i}", 10_000 * (i + 1), 64) for i in range(3)]}
    search = PerTableSearch(specs, 8, "contiguous", 8, 10 * GIB, Workload(batch_size=512), PRESETS["paper"].link_model)
    search.search({f"t{i}": 8 for i in range(3)}, {})
    assert search.exact and search.evaluations == 4 ** 3 <= EXACT_LIMIT  # every assignment of 3 tables, 4 sizes
    many = {"m": [TableSpec(f"t{i}", 10_000 * (i + 1), 64) for i in range(6)]}
    search = PerTableSearch(many, 16, "contiguous", 8, 10 * GIB, Workload(batch_size=512), PRESETS["paper"].link_model)
    search.search({f"t{i}": 16 for i in range(6)}, {"t0": 16})
    assert not search.exact
    assert search.evaluations <= 1 + 5 * 5 + MAX_PASSES * 5 * (5 - 1)  # start, block moves, single moves


def test_the_busiest_rank_sums_its_positions_over_the_group_sizes():
    specs = {"m": [TableSpec("a", 1_000_000, 64), TableSpec("b", 1_000_000, 64)]}
    search = PerTableSearch(specs, 4, "contiguous", 4, 100 * GIB, Workload(batch_size=64), PRESETS["paper"].link_model)
    both = search.evaluate({"a": 2, "b": 4})
    two, four = both.parts  # by size
    assert both.fits and (two.size, four.size) == (2, 4)
    # contiguous: rank r sits at position r % 2 of its group of 2 and r % 4 of its group of 4
    assert both.memory == pytest.approx(max(two.memory[r % 2] + four.memory[r % 4] for r in range(4)))


def test_the_simulator_reports_a_per_table_layout_next_to_the_global_ones():
    scenario = Scenario(tuple(PRESETS["pinterest"].tables), hardware=PRESETS["pinterest"].hardware,
                        world_sizes=(64,), dense_flops_per_sample=13e9, per_table=True, sync_intervals=(16,))
    points = simulate(scenario).points
    assert [p.layout for p in points] == ["1D", "2D", "PT"]
    pt, best = points[2], min((p for p in points[:2] if p.fits), key=lambda p: p.step_time)
    assert pt.fits and pt.step_time <= best.step_time  # the search starts from the best global layout
    assert sum(len(tables) for tables in pt.tables_by_size().values()) == len(scenario.tables)


def test_a_sharding_entry_for_an_unknown_table_is_refused():
    with pytest.raises(ValueError, match=r"sharding names unknown tables \['bigg'\]; the model's tables are"):
        plan_for_strategy(SKEWED, request(2, {"bigg": {"shard_group_size": 8}}))


def test_table_names_repeated_across_collections_keep_the_global_layout():
    tables = {"a": [("t", 1000, 16)], "b": [("t", 2000, 16)]}
    planned = plan_for_strategy(tables, request(world=4, budget_gib=1.0))
    assert not planned.plan.per_table and "not searched (table names repeat across collections" in planned.explanation
    with pytest.raises(ValueError, match=r"tables \['t'\] are named in several collections"):
        plan_for_strategy(tables, request(2, {"t": {"shard_group_size": 4}}, world=4, budget_gib=1.0))


def test_the_smallest_tables_move_together_where_one_at_a_time_never_pays():
    """One 4 M-row table that fits only once in 1.75 GiB, 26 small ones, 4 ranks on 2 nodes with slow links
    between them: one small table alone in groups of 2 pays a new all-to-all and round for nothing, all of
    them together keep their all-to-all inside a node."""
    tables = {"sparse": [("big", 4_000_000, 64)] + [(f"s{i}", 100_000, 64) for i in range(26)]}
    workload = Workload(batch_size=4096, optimizer="rowwise_adagrad", sync_interval=8, sync_bytes=2, sync_overlap=True)
    planned = plan_for_strategy(tables, PlanRequest(4, 2, 1.75 * GIB, workload, links="a100-p4d",
                                                    placement="contiguous"))
    sizes = {t: ts.size_in(planned.plan.shard_group_size) for t, ts in planned.plan.modules["sparse"].items()}
    assert sizes["big"] == 4 and {sizes[f"s{i}"] for i in range(26)} == {2}, planned.explanation
    assert "below the best global layout S=4 contiguous" in planned.explanation
