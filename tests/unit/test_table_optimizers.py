"""Per-table sparse optimizer settings (``sparse_per_table``) on one process: parsing and its errors, the
twins' parts (one optimizer a kernel), the planner's memory account of each table's state, the replica
rounds of kernels with different optimizers in one group, and what set-up and ``plan`` print."""

from __future__ import annotations

import json
import re

import lightning.pytorch as pl
import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_twod import TwoDSparseStrategy
from lightning_twod.checkpoint.tables import _saved_optimizers
from lightning_twod.cli.plan import plan_main
from lightning_twod.core.shards import place_tables
from lightning_twod.distributed import MeshGroups
from lightning_twod.models.dlrm import DLRM
from lightning_twod.planner.inputs import FP32_BYTES, TableSpec, Workload
from lightning_twod.planner.links import resolve_links
from lightning_twod.planner.storage import predict_storage
from lightning_twod.replication.reducer import ReplicatedKernel, _split_groups
from lightning_twod.sparse.kernels import ShardShape, TorchKernel
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.table_optimizers import OptimizerSettings, table_settings
from lightning_twod.sparse.wrap import shard_model
from lightning_twod.strategies.options import OptionError, TwoDOptions
from lightning_twod.strategies.planning import check_column_wise
from tests.helpers.cli_cases import write_config
from tests.helpers.sparse_cases import constraints, make_module

DEFAULT = OptimizerSettings("rowwise_adagrad", 0.05, 1e-8, (0.9, 0.999), 0.0, "auto")


def test_an_entry_overrides_the_keys_it_names_and_keeps_the_strategys_others():
    settings = table_settings(DEFAULT, {"optimizer": "rowwise_adam", "lr": 1e-3, "betas": [0.8, 0.95]}, "t_big")
    assert settings == OptimizerSettings("rowwise_adam", 1e-3, 1e-8, (0.8, 0.95), 0.0, "auto")
    assert table_settings(DEFAULT, {"lr": 0.1}, "t").optimizer == "rowwise_adagrad"
    assert settings.describe(DEFAULT) == "optimizer='rowwise_adam', lr=0.001, betas=(0.8, 0.95)"
    config = settings.on_layout(data_parallel=False, world_size=4, shard_group_size=2, sync_mode="weights")
    assert (config.name, config.lr, config.beta1, config.beta2) == ("rowwise_adam", 1e-3, 0.8, 0.95)


@pytest.mark.parametrize("entry, message", [
    ({"learning_rate": 0.1}, r"sparse_per_table\['t_big'\]: unknown key\(s\) \['learning_rate'\] \('learning_rate' is "
                             r"TorchRec's; here it is 'lr'\); use optimizer, lr, eps, betas, weight_decay, momentum_scale"),
    ({"optimizer": "adagrad"}, r"sparse_per_table\['t_big'\]: unknown sparse optimizer 'adagrad'; use one of"),
    ({"weight_decay": 0.1}, r"sparse_per_table\['t_big'\]: sparse optimizer 'rowwise_adagrad' has no weight decay"),
    ({"lr": 0}, r"sparse_per_table\['t_big'\]: sparse optimizer needs lr > 0"),
    ({"lr": "fast"}, r"sparse_per_table\['t_big'\]: lr='fast'; use a number"),
    ({"optimizer": "adam", "betas": 0.9}, r"sparse_per_table\['t_big'\]: betas=0.9; use two numbers"),
    ({"optimizer": "adam", "betas": (0.9, 1.0)}, r"sparse_per_table\['t_big'\]: sparse optimizer 'adam' needs 0 <= beta1"),
    ({"momentum_scale": -1}, r"sparse_per_table\['t_big'\]: momentum_scale=-1; use a number > 0 or 'auto'"),
    ("rowwise_adam", r"sparse_per_table\['t_big'\]='rowwise_adam'; use a mapping of the settings it overrides"),
])
def test_a_bad_entry_names_the_table_the_key_and_the_fix(entry, message):
    with pytest.raises(ValueError, match=message):
        table_settings(DEFAULT, entry, "t_big")
    with pytest.raises(OptionError, match="TwoDSparseStrategy: " + message):
        TwoDSparseStrategy(sparse_optimizer="rowwise_adagrad", sparse_per_table={"t_big": entry})


def test_column_wise_is_refused_for_the_tables_whose_own_optimizer_reads_whole_rows():
    with pytest.raises(OptionError, match=r"sharding asks for table 't_big' column_wise but "
                                          r"sparse_optimizer='rowwise_adam' computes .* \(sparse_per_table gives table "
                                          r"'t_big' 'rowwise_adam'\)"):
        TwoDOptions(sharding={"t_big": "column_wise"}, sparse_per_table={"t_big": {"optimizer": "rowwise_adam"}})
    # a table whose own optimizer is element-wise may be cut by columns under a strategy-wide rowwise_adam
    options = TwoDOptions(sparse_optimizer="rowwise_adam", sharding={"t": "column_wise"},
                          sparse_per_table={"t": {"optimizer": "adam"}})
    assert options.table_optimizers["t"].optimizer == "adam"
    # the planner does not cut such a table by columns even where allow_column_wise lets it cut the others
    workload = TwoDOptions(allow_column_wise=True, sparse_per_table={"t": {"optimizer": "lamb"}}).workload(8)
    assert not workload.cuts_columns("t") and workload.cuts_columns("other")
    # a plan file that cuts it is refused at set-up, naming the table
    plan = {"t": place_tables([("t", 10, 8)], 2, {"t": "column_wise"})["t"]}
    with pytest.raises(ValueError, match=r"the plan cuts table 't' column_wise but sparse_optimizer='lamb'"):
        check_column_wise({"sparse": plan}, workload.optimizer_of)


def test_unknown_tables_are_named_before_any_process_starts_and_at_set_up():
    strategy = TwoDSparseStrategy(sparse_per_table={"t_nope": {"lr": 0.1}}, shard_group_size=1, links="h100")
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)  # sets the strategy's devices
    model = DLRM(table_rows=[100, 50], num_dense=3, embedding_dim=8, bottom_mlp=[8], top_mlp=[8])
    message = ("TwoDSparseStrategy: sparse_per_table names unknown tables ['t_nope']; the model's tables are "
               "['t_cat_0', 't_cat_1']")
    with pytest.raises(MisconfigurationException, match=f"^{re.escape(message)}$"):
        strategy.check_before_launch(model)
    with pytest.raises(MisconfigurationException, match=f"^{re.escape(message)}$"):
        strategy.plan_layout(model, 2**30, resolve_links("h100"))


def _twins(own: dict[str, SparseOptimizerConfig]):
    """The twin of a collection of five tables (one of each type, ``t_dp`` data-parallel) on one process, the
    tables of ``own`` with those optimizers."""
    module = make_module(True, seed=1)
    default = SparseOptimizerConfig("rowwise_adagrad", 0.05)
    plan = place_tables([(t.name, t.num_embeddings, t.embedding_dim) for t in module.tables], 1, constraints())
    spec = ShardingSpec(MeshGroups.single_process(), default, backend="torch", plans={"bags": plan},
                        table_optimizer=lambda table, data_parallel, size: own.get(table))
    return shard_model(nn.ModuleDict({"bags": module}), spec)["bags"], module


def test_tables_with_an_optimizer_of_their_own_train_in_kernels_of_their_own():
    adam = SparseOptimizerConfig("rowwise_adam", 1e-3, beta1=0.8)
    fast = SparseOptimizerConfig("rowwise_adagrad", 0.5)
    twin, module = _twins({"t_rw": adam, "t_tw2": adam, "t_dp": fast})
    parts = {tuple(t.name for t in part.tables): part for part in twin.parts()}
    assert set(parts) == {("t_tw", "t_cw"), ("t_rw", "t_tw2"), ("t_dp",)}
    assert parts[("t_rw", "t_tw2")].kernel.optimizer == adam and parts[("t_dp",)].local_kernel.optimizer == fast
    assert parts[("t_tw", "t_cw")].kernel.optimizer.name == "rowwise_adagrad"
    states = {shard.table: set(state) for part in twin.parts() for kernel, shards in part.kernel_shards()
              for shard, state in zip(shards, kernel.shard_states(), strict=True)}
    assert states["t_rw"] == {"momentum1", "momentum2", "step"} and states["t_tw"] == {"momentum1"}
    assert twin.output_features == module.feature_names  # one result in the collection's order


def test_the_memory_account_counts_each_tables_own_state():
    own = {"t_rw": SparseOptimizerConfig("rowwise_adam"), "t_cw": SparseOptimizerConfig("adam"),
           "t_tw2": SparseOptimizerConfig("sgd")}
    twin, module = _twins(own)
    held = sum(state.numel() * state.element_size() for part in twin.parts() for kernel in part.kernels()
               for states in kernel.shard_states() for state in states.values())
    specs = [TableSpec.from_config(t) for t in module.tables]
    plan = {name: sharding for part in twin.parts() for name, sharding in part.plan.items()}
    workload = Workload(optimizer="rowwise_adagrad", table_optimizers=tuple((t, c.name) for t, c in own.items()))
    assert predict_storage(specs, plan, 1, workload)[0].optimizer == held
    rows = {t.name: t.num_embeddings for t in module.tables}
    assert held == FP32_BYTES * (rows["t_rw"] * (8 + 2) + rows["t_cw"] * (2 * 16 + 1) + rows["t_tw"] + rows["t_dp"])
    assert predict_storage(specs, plan, 1, Workload(optimizer="rowwise_adagrad"))[0].optimizer != held


def test_a_round_sends_the_exact_states_of_every_kernel_that_has_them_in_fp32():
    """Kernels of one process group with different optimizers: the Adam family's second moment and step go in
    the fp32 round whichever kernel comes first in the group."""
    shard = [ShardShape(6, 4)]
    adagrad = TorchKernel(shard, [0], True, SparseOptimizerConfig("rowwise_adagrad"))
    adam = TorchKernel(shard, [0], True, SparseOptimizerConfig("rowwise_adam"))
    members = [ReplicatedKernel(adagrad, None, [0]), ReplicatedKernel(adam, None, [0])]
    wire, exact = _split_groups(members, "bf16")
    assert (wire.part, wire.sync_dtype, exact.part, exact.sync_dtype) == ("wire", "bf16", "exact", "fp32")
    assert [m.kernel for m in exact.members] == [adam]
    assert [len(t) for t in exact.shard_tensors(exact.members[0])] == [2]  # momentum2, step
    assert [len(t) for m in wire.members for t in wire.shard_tensors(m)] == [2, 2]  # weights + momentum1 each
    assert len(_split_groups(members, "fp32")) == 1


def test_plan_and_set_up_name_each_tables_own_settings():
    strategy = TwoDSparseStrategy(sparse_optimizer="rowwise_adagrad", sparse_lr=0.05,
                                  sparse_per_table={"t_big": {"optimizer": "rowwise_adam", "lr": 1e-3},
                                                    "t_small": {"lr": 0.05}})
    assert strategy.table_optimizer_summary() == ("sparse_per_table: 't_big': optimizer='rowwise_adam', lr=0.001; "
                                                  "'t_small': as the strategy")
    assert TwoDSparseStrategy().table_optimizer_summary() == ""



@pytest.mark.parametrize("saved", [["rowwise_adam"], {"net.t.weight": "adagrad"}, {"net.t.weight": 3}])
def test_a_checkpoints_table_optimizers_are_read_as_names_only(tmp_path, saved):
    (tmp_path / "layout.json").write_text(json.dumps({"table_optimizers": saved}))
    with pytest.raises(ValueError, match=r"layout.json: 'table_optimizers' must map table keys to sparse optimizers"):
        _saved_optimizers(tmp_path)
    (tmp_path / "layout.json").write_text(json.dumps({"table_optimizers": {"net.t.weight": "rowwise_adam"}}))
    assert _saved_optimizers(tmp_path) == {"net.t.weight": "rowwise_adam"}
    (tmp_path / "layout.json").write_text(json.dumps({}))  # written by an earlier version
    assert _saved_optimizers(tmp_path) == {}


def test_plan_reads_per_table_settings_from_the_yaml_config_and_prints_them(tmp_path, capsys):
    config = write_config(tmp_path)
    entry = "--trainer.strategy.init_args.sparse_per_table={t_cat_0: {optimizer: rowwise_adam, lr: 0.001, betas: [0.8, 0.9]}}"
    assert plan_main(["--config", str(config), "--trainer.devices=4", "--trainer.strategy.init_args.shard_group_size=2",
                      entry]) == 0
    text = capsys.readouterr().out
    assert "sparse optimizer: optimizer='momentum_rowwise_adagrad', lr=0.01" in text
    assert "\nsparse_per_table: 't_cat_0': optimizer='rowwise_adam', lr=0.001, betas=(0.8, 0.9)\n" in text
    assert "kernel backend: torch (auto: FBGEMM's PARTIAL_ROWWISE_ADAM corrects bias with one step count" in text \
        or "fbgemm_gpu does not import" in text
