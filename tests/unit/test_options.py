"""``TwoDOptions``: each option documented on its field, the docs made from those fields, one error per
bad value naming the option, frozen, and the same options in both strategies' signatures (no process is
started)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from lightning_twod.planner import PRESETS
from lightning_twod.strategies.fabric import TwoDSparseFabricStrategy
from lightning_twod.strategies.options import (
    HOST_ARGUMENTS,
    TABLE_END,
    TABLE_START,
    TwoDOptions,
    configuration_page,
    option_docs,
    strategy_docstring,
    write_configuration_table,
)
from lightning_twod.strategies.strategy import TwoDSparseStrategy

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
#: Parameters of the strategies that are not 2D options.
NOT_OPTIONS = ("self", *HOST_ARGUMENTS, "kwargs")
FIELDS = dataclasses.fields(TwoDOptions)
REGENERATE = "run `python -m lightning_twod.strategies.options` to rewrite it from the TwoDOptions fields"


def documented_defaults() -> dict[str, object]:
    """``{argument: default}`` of the ``TwoDSparseStrategy`` table in ``docs/configuration.md``."""
    text = CONFIGURATION.read_text().split("## `EmbeddingTableConfig`")[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", text, flags=re.MULTILINE)
    return {name: ast.literal_eval(default) for name, default in rows}


def test_defaults_are_the_documented_ones():
    documented = documented_defaults()
    assert {f.name: f.default for f in FIELDS} == {f.name: documented[f.name] for f in FIELDS}
    assert TwoDSparseStrategy().options == TwoDOptions() == TwoDSparseFabricStrategy().options


def test_every_option_is_documented_on_its_field():
    docs = option_docs()
    assert list(docs) == [f.name for f in FIELDS]
    assert docs["sparse_eps"] == "Epsilon of AdaGrad and of the Adam family."
    assert docs["sync_interval"].startswith("Optimizer steps between cross-group reductions")


def test_the_configuration_page_table_is_made_from_the_fields():
    """The committed table is what the fields give: the fields are the one place to edit."""
    text = CONFIGURATION.read_text()
    assert configuration_page(text) == text, f"docs/configuration.md is stale: {REGENERATE}"
    table = text.split(TABLE_START)[1].split(TABLE_END)[0]
    for name in [*option_docs(), *HOST_ARGUMENTS]:
        assert f"| `{name}` |" in table
    assert "| `sparse_eps` | `1e-8` | Epsilon of AdaGrad and of the Adam family. |" in table


def test_the_page_is_rewritten_between_its_markers_only(tmp_path):
    page = tmp_path / "configuration.md"
    page.write_text(f"# Title\n\n{TABLE_START}\n| old |\n{TABLE_END}\n\nAfter.\n")
    write_configuration_table(page)
    text = page.read_text()
    assert text.startswith(f"# Title\n\n{TABLE_START}\n| argument | default | meaning |\n")
    assert "| old |" not in text and text.endswith(f"|\n{TABLE_END}\n\nAfter.\n")


@pytest.mark.parametrize("strategy", [TwoDSparseStrategy, TwoDSparseFabricStrategy])
def test_the_strategy_docstring_is_made_from_the_fields(strategy):
    summary, args = strategy.__doc__.split("\n\nArgs:\n")
    assert strategy.__doc__ == strategy_docstring(summary), f"{strategy.__name__}.__doc__ is not strategy_docstring's"
    names = re.findall(r"^    (\w+): ", args, flags=re.MULTILINE)
    assert names == [f.name for f in FIELDS] + list(HOST_ARGUMENTS)
    assert "    sparse_eps: Epsilon of AdaGrad and of the Adam family.\n" in args


@pytest.mark.parametrize("strategy", [TwoDSparseStrategy, TwoDSparseFabricStrategy])
def test_the_host_arguments_are_documented_with_their_defaults(strategy):
    parameters = inspect.signature(strategy.__init__).parameters
    assert {name: parameters[name].default for name in HOST_ARGUMENTS} == \
        {name: default for name, (default, _) in HOST_ARGUMENTS.items()}


@pytest.mark.parametrize(("option", "bad"), [
    ("shard_group_size", 0), ("shard_group_size", True), ("placement", "diagonal"), ("sync_interval", 0),
    ("sync_interval", 1.5), ("sync_mode", "params"), ("sync_dtype", "fp8"), ("sparse_optimizer", "adagrad"),
    ("sparse_lr", 0.0), ("sparse_lr", "fast"), ("sparse_eps", -1e-3), ("momentum_scale", 0), ("kernel_backend", "cuda"),
    ("comm_dtype", "int8"), ("init_shards", "random"), ("pipeline", "yes"), ("verify_replicas", "always"),
    ("verify_replicas", 0), ("memory_per_rank_gb", -1.0), ("planner_batch_size", 0), ("links", 12),
    ("sparse_betas", (0.9, 1.0)), ("sparse_betas", (0.9,)), ("sparse_weight_decay", -0.1),
    ("sparse_weight_decay", 0.1),
])
def test_a_bad_value_raises_naming_the_option(option, bad):
    with pytest.raises(ValueError, match=rf"{option}={re.escape(repr(bad))}; "):
        TwoDOptions(**{option: bad})


def test_a_bad_sharding_names_the_table():
    with pytest.raises(ValueError, match=r"table 'item': unknown sharding 'diagonal'"):
        TwoDOptions(sharding={"item": "diagonal"})


def test_options_that_contradict_sync_mode_gradients_are_refused():
    with pytest.raises(ValueError, match="sync_mode='gradients'.*drop them"):
        TwoDOptions(sync_mode="gradients", sync_dtype="bf16")
    with pytest.raises(ValueError, match="use kernel_backend='torch' or 'auto'"):
        TwoDOptions(sync_mode="gradients", kernel_backend="fbgemm")


def test_values_are_kept_in_one_form():
    options = TwoDOptions(verify_replicas=None, sync_mode="gradients", links="a100-p4d", sync_overlap=0)
    assert options.verify_replicas == "off" and options.kernel_backend == "torch" and options.sharding == {}
    assert options.links is PRESETS["a100-p4d"] and options.sync_overlap is False


def test_options_are_frozen():
    options = TwoDOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.sync_interval = 2


def test_the_workload_the_planner_predicts_follows_the_options():
    options = TwoDOptions(sync_interval=4, sync_dtype="int8", comm_dtype="bf16", sync_overlap=True,
                          sparse_optimizer="sgd", allow_column_wise=True)
    workload = options.workload(batch_size=64)
    assert (workload.batch_size, workload.sync_interval, workload.sync_dtype, workload.comm_bytes) == (64, 4, "int8", 2)
    assert workload.sync_overlap and workload.optimizer == "sgd" and workload.allow_column_wise


@pytest.mark.parametrize("strategy", [TwoDSparseStrategy, TwoDSparseFabricStrategy])
def test_the_strategy_signature_lists_every_option(strategy):
    """Same names, order, defaults and annotations as ``TwoDOptions``: the two cannot drift apart."""
    parameters = [p for name, p in inspect.signature(strategy.__init__).parameters.items()
                  if name not in NOT_OPTIONS]
    assert [(p.name, p.default, p.annotation) for p in parameters] == [(f.name, f.default, f.type) for f in FIELDS]


#: A value other than the default for every option (``sync_mode`` in the second set: it excludes some).
NOT_DEFAULT = [
    dict(shard_group_size=2, placement="strided", sync_interval=3, sync_dtype="bf16", sync_overlap=True,
         sparse_optimizer="sgd", sparse_lr=0.5, sparse_eps=1e-6, momentum_scale=2.0, sharding={"t": "row_wise"},
         kernel_backend="torch", comm_dtype="bf16", init_shards="in_place", validate_inputs=False, pipeline=False,
         verify_replicas=2, memory_per_rank_gb=3.0, plan="plan.yaml", planner_batch_size=64,
         allow_column_wise=True, links="h100", lookup_stats={"t": {"id_skew": 2.0}}),
    dict(sync_mode="gradients"),
    dict(sparse_optimizer="adamw", sparse_betas=(0.8, 0.99), sparse_weight_decay=0.01),
    dict(sparse_per_table={"t_big": {"optimizer": "rowwise_adam", "lr": 1e-3}}),
]


@pytest.mark.parametrize("strategy", [TwoDSparseStrategy, TwoDSparseFabricStrategy])
def test_the_strategy_passes_every_argument_to_the_options(strategy):
    assert set().union(*NOT_DEFAULT) == {f.name for f in FIELDS}
    for values in NOT_DEFAULT:
        assert strategy(**values).options == TwoDOptions(**values)


@pytest.mark.parametrize("strategy", [TwoDSparseStrategy, TwoDSparseFabricStrategy])
def test_a_bad_option_names_the_strategy_the_user_called(strategy):
    with pytest.raises(ValueError, match=rf"^{strategy.__name__}: sync_interval=0"):
        strategy(sync_interval=0)
    with pytest.raises(ValueError, match=rf"^{strategy.__name__}"):
        strategy(links=12)


@pytest.mark.parametrize(("host", "options", "match"), [
    ("trainer", dict(shard_group_size=2), r"shard_group_size=2 does not divide world_size=3; choose one of 1, 3 "
                                          r"\(world_size = num_nodes x devices = 1 x 3\)"),
    ("fabric", dict(shard_group_size=2), r"TwoDSparseFabricStrategy: shard_group_size=2 does not divide world_size=3"),
    ("trainer", dict(shard_group_size=2, placement="auto"), r"shard_group_size=2 does not divide world_size=3"),
    ("trainer", dict(shard_group_size="auto", sharding={"item": {"shard_group_size": 2}}),
     r"table 'item': shard_group_size=2 does not divide world_size=3"),
])
def test_a_mesh_the_devices_cannot_form_fails_where_the_trainer_is_made_before_any_launch(host, options, match):
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=match):  # the unit tier fails any test that starts a process
        if host == "trainer":
            pl.Trainer(accelerator="cpu", devices=3, strategy=TwoDSparseStrategy(**options), logger=False)
        else:
            Fabric(accelerator="cpu", devices=3, strategy=TwoDSparseFabricStrategy(**options))
