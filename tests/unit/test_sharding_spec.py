"""One ``ShardingSpec`` builds every twin of a model: what it holds reaches each of them, on one
process; the sparse optimizer a checkpoint records is structured data, and the planner assumes the
strategies' default optimizer (the spec on meshes: ``tests/system/test_per_table_sharded.py``)."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from lightning_twod.checkpoint.directory import saved_sparse_optimizer
from lightning_twod.core.shards import ShardingType, TableSharding, place_tables
from lightning_twod.distributed import MeshGroups
from lightning_twod.planner.inputs import Workload
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardedEmbeddingBagCollection, ShardingSpec
from lightning_twod.sparse.wrap import shard_collection, shard_model
from lightning_twod.strategies.options import TwoDOptions
from tests.helpers.sparse_cases import make_module


def test_the_spec_reaches_every_twin_of_the_model():
    calls = []
    sgd = SparseOptimizerConfig("sgd", lr=0.5)
    spec = ShardingSpec(MeshGroups.single_process(), sgd, backend="torch", validate_inputs=False,
                        before_read=lambda: calls.append("read"), after_write=lambda: calls.append("write"))
    model = nn.ModuleDict({"bags": make_module(True, seed=1), "plain": nn.Embedding(10, 4)})
    twins = shard_model(model, spec)
    assert sorted(twins) == ["bags", "plain"]
    for path, twin in twins.items():
        assert (twin.validate_inputs, twin.optimizer, twin.spec.backend, twin.path) == (False, sgd, "torch", path)
    state = model.state_dict()
    assert calls.count("read") == len(state)  # every table read after the hook
    model.load_state_dict(state)
    assert calls.count("write") == 2  # once per twin, after its tables were written


def test_the_spec_gives_each_module_its_plan_by_path():
    module = make_module(True, seed=1)
    plan = place_tables([(t.name, t.num_embeddings, t.embedding_dim) for t in module.tables], 1,
                        {t.name: "data_parallel" for t in module.tables})
    model = nn.ModuleDict({"bags": module})
    twin = shard_model(model, ShardingSpec(MeshGroups.single_process(), backend="torch", plans={"bags": plan}))["bags"]
    assert {s.sharding_type for s in twin.plan.values()} == {ShardingType.DATA_PARALLEL}
    assert twin.kernel is None and twin.local_kernel is not None


def test_a_group_size_the_spec_has_no_groups_for_is_refused():
    module = make_module(True, seed=1)
    plan = place_tables([(t.name, t.num_embeddings, t.embedding_dim) for t in module.tables], 1)
    first = module.tables[0].name
    plan[first] = TableSharding(first, plan[first].sharding_type, plan[first].shards, 2)
    with pytest.raises(ValueError, match=r"shard groups of 2 ranks; the spec has groups of \[1\] only"):
        shard_collection(module, ShardingSpec(MeshGroups.single_process(), backend="torch"), plan)


def test_a_twin_is_built_on_the_groups_of_one_size():
    """Splitting a collection by group size is the factory's (``shard_collection``, ``shard_model``): a twin
    built directly refuses a plan that gives its tables another size than its groups'."""
    module = make_module(True, seed=1)
    plan = place_tables([(t.name, t.num_embeddings, t.embedding_dim) for t in module.tables], 1)
    first = module.tables[0].name
    plan[first] = TableSharding(first, plan[first].sharding_type, plan[first].shards, 2)
    with pytest.raises(ValueError, match=rf"tables \['{first}'\] other shard group sizes than these groups' 1"):
        ShardedEmbeddingBagCollection(module, ShardingSpec(MeshGroups.single_process(), backend="torch"), plan)


def test_the_sparse_optimizer_of_a_checkpoint_reads_as_its_fields_in_both_forms():
    config = SparseOptimizerConfig("rowwise_adagrad", lr=0.05, eps=1e-8, momentum_scale=2.0)
    written = {"sparse_optimizer": dataclasses.asdict(config)}
    earlier = {"sparse_optimizer": repr(config)}  # "SparseOptimizerConfig(name='rowwise_adagrad', lr=0.05, ...)"
    assert saved_sparse_optimizer(written) == saved_sparse_optimizer(earlier) == dataclasses.asdict(config)
    assert SparseOptimizerConfig(**saved_sparse_optimizer(earlier)) == config
    assert saved_sparse_optimizer({}) == {}


def test_the_planner_assumes_the_strategies_sparse_optimizer():
    assert Workload().optimizer == TwoDOptions().sparse_optimizer == SparseOptimizerConfig().name
