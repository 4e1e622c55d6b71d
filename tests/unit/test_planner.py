"""The planner on numbers alone (no processes): balance, memory, auto group size, YAML, errors."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_twod.core.mesh import members_per_node as local_members
from lightning_twod.core.shards import Shard, ShardingType, TableSharding, place_tables
from lightning_twod.distributed import MeshGroups
from lightning_twod.planner import (
    PRESETS,
    PlanError,
    PlanRequest,
    ShardingPlan,
    TableSpec,
    Workload,
    choose_layout,
    layout_options,
    partition,
    plan_for_strategy,
    plan_model,
    predict_storage,
    validate_shardings,
)
from lightning_twod.planner.inputs import GIB
from lightning_twod.planner.load import GroupLinks
from lightning_twod.planner.steptime import group_shapes
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingTableConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import embedding_tables, shard_collection


def skewed_tables(seed: int = 0) -> list[TableSpec]:
    """A few huge tables, many small ones, lookups per table following a power law."""
    rng = random.Random(seed)
    specs = [TableSpec(f"huge_{i}", 50_000_000, 128, pooling_factor=20.0) for i in range(3)]
    for i in range(60):
        specs.append(TableSpec(f"small_{i:02d}", rng.randint(1_000, 2_000_000), rng.choice([16, 32, 64, 128]),
                               pooling_factor=max(0.5, 60.0 * (i + 1) ** -1.1)))
    return specs


@pytest.mark.parametrize("group_size", [4, 8, 16])
def test_skewed_tables_are_balanced(group_size):
    specs = skewed_tables()
    # column-wise cuts allowed (one AdaGrad accumulator per column block, as TorchRec)
    plan = plan_model({"sparse": specs}, 64, group_size, Workload(batch_size=2048, allow_column_wise=True),
                      memory_per_rank=80e9)
    imbalance = plan.report.imbalance
    # by default under row-wise AdaGrad: table- and row-wise cuts only (the optimizer's arithmetic kept)
    exact = plan_model({"sparse": specs}, 64, group_size, Workload(batch_size=2048), memory_per_rank=80e9)
    kinds = {t.sharding_type for t in exact.modules["sparse"].values()}
    assert ShardingType.COLUMN_WISE not in kinds
    print(f"S={group_size}: imbalance {imbalance:.3f} (column-wise allowed), "
          f"{exact.report.imbalance:.3f} (table- and row-wise only)")
    assert imbalance <= 1.15
    # the naive size-balanced placement of the same tables is far worse on predicted load
    naive = place_tables([(s.name, s.rows, s.dim) for s in specs], group_size)
    from lightning_twod.planner import evaluate

    naive_report = evaluate({"sparse": specs}, {"sparse": naive}, group_size, Workload(batch_size=2048))
    assert naive_report.imbalance > imbalance
    assert "imbalance (max/mean predicted load)" in str(plan)
    validate_shardings(specs, plan.modules["sparse"], group_size)


def test_memory_limit_forces_cuts_and_is_respected():
    specs = [TableSpec("big", 4_000_000, 64), TableSpec("mid", 500_000, 64), TableSpec("tiny", 100, 8)]
    one_table = 4_000_000 * 65 * 4
    plan = plan_model({"m": specs}, 4, 4, Workload(batch_size=64), memory_per_rank=0.5 * one_table)
    big = plan.modules["m"]["big"]
    assert big.sharding_type in (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
    assert len(big.shards) >= 2
    assert plan.report.max_memory <= 0.5 * one_table


def test_too_large_model_names_tables_and_options():
    specs = [TableSpec("enormous", 10_000_000, 128), TableSpec("small", 1000, 16)]
    with pytest.raises(PlanError) as err:
        plan_model({"sparse": specs}, 2, 2, Workload(batch_size=8), memory_per_rank=1 * GIB)
    message = str(err.value)
    assert "'enormous'" in message
    for option in ("larger shard_group_size", "row_wise", "column_wise", "smaller embedding_dim"):
        assert option in message


def test_constraints_are_respected_and_checked():
    specs = [TableSpec("a", 1000, 16), TableSpec("b", 2000, 32), TableSpec("c", 50, 8)]
    plan = partition(specs, 4, constraints={"a": "row_wise", "b": "column_wise", "c": "data_parallel"})
    assert plan["a"].sharding_type == ShardingType.ROW_WISE and len(plan["a"].shards) == 4
    assert plan["b"].sharding_type == ShardingType.COLUMN_WISE
    owners = [s.owner for s in sorted(plan["b"].shards, key=lambda s: s.col_start)]
    assert owners == sorted(owners) and len(set(owners)) == len(owners)
    assert plan["c"].sharding_type == ShardingType.DATA_PARALLEL and plan["c"].shards[0].owner == -1
    with pytest.raises(ValueError, match="unknown tables"):
        partition(specs, 4, constraints={"nope": "row_wise"})


def _slow_network(links=PRESETS["h100"]):
    """The h100 preset with a 0.1 GB/s network: what crosses nodes dominates."""
    from dataclasses import replace

    from lightning_twod.planner import CollectiveCost

    return replace(links, all_to_all_inter=CollectiveCost(0.1e9, 50e-6),
                   all_reduce_inter=CollectiveCost(0.1e9, 50e-6), name="slow-net")


UNIFORM = {"sparse": [TableSpec(f"t{i}", 1_000_000, 64, pooling_factor=4) for i in range(8)]}
MODEL_BYTES = 8 * 1_000_000 * 65 * 4


def test_layout_options_list_each_layout_once():
    assert layout_options(4, "auto", "auto") == [(1, "contiguous"), (2, "contiguous"), (2, "strided"),
                                                 (4, "contiguous")]
    assert layout_options(8, 4, "auto") == [(4, "contiguous"), (4, "strided")]
    assert layout_options(8, "auto", "strided") == [(1, "strided"), (2, "strided"), (4, "strided"), (8, "strided")]


def test_auto_layout_is_the_fastest_predicted_that_fits():
    workload = Workload(batch_size=2048, sync_interval=1)
    best, candidates, line = choose_layout(UNIFORM, 32, 8, MODEL_BYTES / 3, workload, _slow_network())
    fitting = [c for c in candidates if c.fits]
    assert {c.group_size for c in candidates if not c.fits} == {1, 2}  # 1 and 2 do not fit
    assert best.time.total == min(c.time.total for c in fitting)
    # every step, nearly every row of a 1M-row table is touched: the reduction must stay inside a
    # node, so the replica groups are consecutive ranks (strided placement)
    replica = group_shapes(32, best.group_size, best.placement, 8)[1]
    assert best.placement == "strided" and not replica.spans_nodes
    # the log: why on the first line, then one line per candidate with its phases and memory
    head, *rest = line.splitlines()
    assert f"shard_group_size={best.group_size}, placement=strided" in head and "lowest predicted step time" in head
    assert "links: slow-net" in head
    rows = rest[1:]
    assert len(rows) == len(candidates) and sum(r.lstrip().startswith("*") for r in rows) == 1
    for c, row in zip(candidates, rows):
        assert c.label in row
        assert ("does not fit" in row) != c.fits
        if c.fits:
            assert "x-group" in row and "out a2a" in row and "GiB" in row


def test_auto_layout_follows_the_reduction_interval():
    # a round every 1,000 steps costs next to nothing: keeping the all-to-all inside a node wins
    rare = Workload(batch_size=2048, sync_interval=1000)
    best, _, _ = choose_layout(UNIFORM, 32, 8, MODEL_BYTES / 3, rare, _slow_network())
    assert best.placement == "contiguous" and best.group_size == 8
    # and a pinned layout is kept, whatever it costs
    pinned, candidates, line = choose_layout(UNIFORM, 32, 8, MODEL_BYTES / 3, rare, _slow_network(), group_size=4,
                                             placement="strided")
    assert (pinned.group_size, pinned.placement) == (4, "strided") and len(candidates) == 1
    assert "as configured" in line and "\n" not in line


def test_nothing_fits_names_every_layout():
    with pytest.raises(PlanError, match="no layout of 4 ranks fits") as err:
        choose_layout(UNIFORM, 4, 4, MODEL_BYTES / 100, Workload(batch_size=16), "h100")
    assert "S=1 contiguous" in str(err.value) and "S=4 contiguous" in str(err.value)


def test_plan_yaml_round_trip(tmp_path):
    specs = skewed_tables()[:20]
    plan = plan_model({"sparse": specs, "tower.item_emb": [TableSpec("tower.item_emb", 300, 12)]}, 16, 8,
                      constraints={"small_03": "row_wise", "small_04": "data_parallel"})
    text = plan.to_yaml()
    again = ShardingPlan.from_yaml(text)
    assert again == plan  # same group size, world, placement and every TableSharding
    assert again.modules["sparse"]["small_03"].sharding_type == ShardingType.ROW_WISE
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert ShardingPlan.load(path).modules == plan.modules
    assert again.to_yaml() == text
    # a plan computed twice is the same plan
    assert plan_model({"sparse": specs, "tower.item_emb": [TableSpec("tower.item_emb", 300, 12)]}, 16, 8,
                      constraints={"small_03": "row_wise", "small_04": "data_parallel"}).to_yaml() == text


def test_pinned_plan_is_used_and_checked(tmp_path):
    tables = {"sparse": [EmbeddingTableConfig("a", 100, 8, ["fa"]), EmbeddingTableConfig("b", 60, 8, ["fb"])]}
    pinned = ShardingPlan(2, 4, {"sparse": {
        "a": TableSharding("a", ShardingType.ROW_WISE, (Shard("a", 0, 50, 0, 8, 0), Shard("a", 50, 100, 0, 8, 1))),
        "b": TableSharding("b", ShardingType.TABLE_WISE, (Shard("b", 0, 60, 0, 8, 1),)),
    }})
    path = tmp_path / "pinned.yaml"
    pinned.save(path)
    batch = Workload(batch_size=32)
    size, plans, line = plan_for_strategy(tables, PlanRequest(4, 4, GIB, batch, pinned=str(path)))[:3]
    assert size == 2 and plans == pinned.modules and "pinned" in line
    with pytest.raises(ValueError, match="world_size"):
        plan_for_strategy(tables, PlanRequest(8, 4, GIB, batch, pinned=pinned))
    with pytest.raises(ValueError, match="shard_group_size=4"):
        plan_for_strategy(tables, PlanRequest(4, 4, GIB, batch, 4, pinned=pinned))
    bad = ShardingPlan(2, 4, {"sparse": {**pinned.modules["sparse"],
                                          "b": TableSharding("b", ShardingType.TABLE_WISE, (Shard("b", 0, 50, 0, 8, 1),))}})
    with pytest.raises(ValueError, match="cover"):
        plan_for_strategy(tables, PlanRequest(4, 4, GIB, batch, pinned=bad))


def test_plan_without_report_counts_copies_in_words():
    plan = ShardingPlan(2, 4, {"sparse": {
        "a": TableSharding("a", ShardingType.ROW_WISE, (Shard("a", 0, 50, 0, 8, 0), Shard("a", 50, 100, 0, 8, 1))),
        "b": TableSharding("b", ShardingType.ROW_WISE, tuple(Shard("b", 15 * i, 15 * i + 15, 0, 8, i) for i in range(4)),
                           group_size=4),
    }})
    text = plan.describe()
    assert "sparse.a: row_wise on [0, 1] of each group of 2 (2 copies)" in text
    assert "sparse.b: row_wise on [0, 1, 2, 3] of each group of 4 (1 copy)" in text


def test_column_blocks_must_follow_owner_order():
    spec = TableSpec("c", 10, 8)
    swapped = TableSharding("c", ShardingType.COLUMN_WISE, (Shard("c", 0, 10, 0, 4, 1), Shard("c", 0, 10, 4, 8, 0)))
    with pytest.raises(ValueError, match="increasing column order"):
        validate_shardings([spec], {"c": swapped}, 2)


def test_storage_matches_single_process_allocation():
    configs = [EmbeddingTableConfig("a", 5000, 16, ["fa", "fa2"]), EmbeddingTableConfig("b", 300, 8, ["fb"])]
    module = EmbeddingBagCollection(configs)
    specs = [TableSpec.from_config(c) for c in configs]
    for optimizer in ("rowwise_adagrad", "sgd"):
        from lightning_twod.sparse.optimizers import SparseOptimizerConfig

        plan = partition(specs, 1)
        sharded = shard_collection(module, ShardingSpec(MeshGroups.single_process(), backend="torch",
                                                        optimizer=SparseOptimizerConfig(optimizer)), plan=plan)
        allocated = sum(p.numel() * 4 for k in sharded.kernels() for p in k.parameters())
        allocated += sum(s.numel() * 4 for k in sharded.kernels() for s in k.optimizer_states())
        storage = predict_storage(specs, plan, 1, Workload(batch_size=8, optimizer=optimizer))[0]
        assert abs(allocated - (storage.weights + storage.optimizer)) <= 0.05 * allocated


def test_links_and_locality():
    h100 = PRESETS["h100"]
    inside = GroupLinks.for_group(h100, 8, 8)
    across = GroupLinks.for_group(h100, 16, 8)
    assert inside.seconds_per_byte < across.seconds_per_byte
    assert across.latency > inside.latency
    assert GroupLinks.for_group(h100, 1, 1).seconds_per_byte == 0.0
    assert local_members(8, 1, 8) == 8 and local_members(4, 2, 8) == 4 and local_members(4, 8, 8) == 1


def test_id_skew_changes_row_wise_shares_and_unique_rows():
    uniform = TableSpec("t", 1000, 8)
    skewed = TableSpec("t", 1000, 8, id_skew=3.0)
    hashed = TableSpec("t", 1000, 8, id_skew=3.0, hashed=True)
    assert uniform.access_fraction(0, 250) == pytest.approx(0.25)
    assert skewed.access_fraction(0, 250) == pytest.approx(0.25 ** (1 / 3))
    assert hashed.access_fraction(0, 250) == pytest.approx(0.25)
    assert skewed.expected_unique(0, 1000, 500) < uniform.expected_unique(0, 1000, 500)
    # the uniform formula against sampling
    draws = torch.randint(0, 1000, (20, 500))
    measured = sum(len(set(row.tolist())) for row in draws) / 20
    assert uniform.expected_unique(0, 1000, 500) == pytest.approx(measured, rel=0.03)


def test_embedding_tables_finds_collections_and_plain_modules():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = EmbeddingBagCollection([EmbeddingTableConfig("a", 10, 4, ["fa"])])
            self.extra = torch.nn.EmbeddingBag(7, 4, mode="mean")

    found = embedding_tables(Model())
    assert list(found) == ["sparse", "extra"]
    assert found["extra"][0].num_embeddings == 7 and found["extra"][0].pooling == "mean"
