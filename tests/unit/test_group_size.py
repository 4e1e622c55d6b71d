"""A shard group size is checked by one function (``core.mesh.check_group_size``): every place that takes
one (the mesh, a plan, the planner, ``sharding``, the strategies before launch, the emulator) refuses a
size that does not divide the world with the same message, naming the table where there is one."""

from __future__ import annotations

import pytest

from lightning_twod.core.mesh import AUTO_GROUP_SIZE, SparseParallelDims, check_group_size, divisors
from lightning_twod.planner.inputs import TableSpec
from lightning_twod.planner.layout import PlanRequest, split_choices
from lightning_twod.planner.partition import plan_model
from lightning_twod.planner.plan import ShardingPlan
from lightning_twod.strategies.fabric import TwoDSparseFabricStrategy
from lightning_twod.strategies.options import TwoDOptions
from lightning_twod.strategies.strategy import TwoDSparseStrategy
from lightning_twod.testing.emulator import EmulatedLayout

MESSAGE = "shard_group_size=3 does not divide world_size=8; choose one of 1, 2, 4, 8"


@pytest.mark.parametrize(("check", "prefix"), [
    (lambda: SparseParallelDims(8, 3), ""),
    (lambda: ShardingPlan(shard_group_size=3, world_size=8, modules={}), ""),
    (lambda: plan_model({"sparse": [TableSpec("t", 100, 8)]}, 8, 3), ""),
    (lambda: split_choices({"item": {"shard_group_size": 3}}, 8), "table 'item': "),
    (lambda: EmulatedLayout(world_size=8, shard_group_size=3), "every table: "),
    (lambda: EmulatedLayout(world_size=8, shard_group_size=2, group_sizes=(("item", 3),)), "item: "),
])
def test_every_place_refuses_a_size_that_does_not_divide_the_world_alike(check, prefix):
    with pytest.raises(ValueError) as raised:
        check()
    assert str(raised.value) == prefix + MESSAGE


@pytest.mark.parametrize(("size", "message"), [
    (0, "shard_group_size=0 must be >= 1; choose one of 1, 2, 4 (divisors of world_size=4)"),
    ("two", "shard_group_size must be an int, got 'two' (str); choose one of 1, 2, 4 (divisors of world_size=4)"),
    (True, "shard_group_size must be an int, got True (bool); choose one of 1, 2, 4 (divisors of world_size=4)"),
])
def test_a_size_that_is_not_a_positive_int_is_refused(size, message):
    with pytest.raises(ValueError) as raised:
        check_group_size(size, 4)
    assert str(raised.value) == message


def test_a_size_that_divides_the_world_passes():
    for size in divisors(12):
        check_group_size(size, 12, "table 't'")
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_auto_is_the_one_default_of_the_group_size():
    assert TwoDOptions().shard_group_size == AUTO_GROUP_SIZE == PlanRequest(8, None, 1.0).shard_group_size
    assert TwoDSparseStrategy().options.shard_group_size == AUTO_GROUP_SIZE
    assert TwoDSparseFabricStrategy().options.shard_group_size == AUTO_GROUP_SIZE
