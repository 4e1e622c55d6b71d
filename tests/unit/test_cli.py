"""The command line in-process: ``plan`` with fit's parser and overrides (pinned layouts, nothing
measured), the data's table sizes linked into the model, ``prog``, ``--version``/``--help`` and the
console script. What starts processes (fit, the links probe, a fresh interpreter) is in
``tests/system/test_cli.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod.cli.main import main
from lightning_twod.cli.plan import plan_main
from lightning_twod.core.shards import ShardingType
from lightning_twod.planner import ShardingPlan
from lightning_twod.strategies.planning import DEFAULT_PLANNER_BATCH, batch_size_of
from tests.helpers.cli_cases import write_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def config(tmp_path) -> Path:
    return write_config(tmp_path)


def test_plan_takes_fits_overrides_and_saves(config, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert plan_main(["--config", str(config), "--trainer.devices=4",
                      "--trainer.strategy.init_args.shard_group_size=2", "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert "shard_group_size=2, placement=contiguous (2 replica group(s) x 2 rank(s))" in text
    assert "batch 48 per rank" in text
    assert "1D (1 x 4) vs 2D (2 x 2)" in text and "imbalance" in text
    plan = ShardingPlan.load(out)
    assert plan.world_size == 4 and plan.shard_group_size == 2
    assert plan.modules["sparse"]["t_cat_0"].sharding_type == ShardingType.ROW_WISE  # the config's constraint
    rows = {name: max(shard.row_end for shard in t.shards) for name, t in plan.modules["sparse"].items()}
    assert rows == {"t_cat_0": 3000, "t_cat_1": 60, "t_cat_2": 900}, "table sizes from the data"


def test_table_rows_come_from_the_data_and_a_different_model_value_is_refused(config, capsys):
    with pytest.raises(MisconfigurationException, match=r"model.init_args.table_rows=\[7, 7\] disagrees with the data's "
                                         r"table_rows=\[3000, 60, 900\] \(SyntheticDataModule\)"):
        plan_main(["--config", str(config), "--model.init_args.table_rows=[7, 7]"])
    # the same values as the data's are fine (configs that still repeat them keep working)
    assert plan_main(["--config", str(config), "--model.init_args.table_rows=[3000, 60, 900]",
                      "--model.init_args.num_dense=5"]) == 0


def test_plan_refuses_a_strategy_that_is_not_2d(config, capsys):
    with pytest.raises(SystemExit) as exited:
        plan_main(["--config", str(config), "--trainer.strategy=ddp"])
    assert exited.value.code != 0
    assert "trainer.strategy is DDPStrategy: plan needs the 2D strategy" in capsys.readouterr().err


def test_prog_is_lightning_twod(capsys):
    for command in ("fit", "plan", "simulate"):
        with pytest.raises(SystemExit) as exited:
            main([command, "--help"])
        done = capsys.readouterr()
        assert exited.value.code == 0, done.err[-2000:]
        first = done.out.splitlines()[0]
        assert first.startswith("usage: lightning-twod ") and f" {command} " in f"{first} ", first


def test_version_and_the_list_of_commands(capsys):
    import lightning_twod

    for argv, code in ((["--version"], 0), (["-V"], 0), (["--help"], 0), ([], 2), (["nonsense"], 2)):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == code, argv
        out = capsys.readouterr().out
        if argv[:1] in (["--version"], ["-V"]):
            assert out == f"lightning-twod {lightning_twod.__version__}\n"
        else:
            assert out.startswith("usage: lightning-twod COMMAND") and "  calibrate " in out and "  --version " in out


def test_the_console_script_is_the_dispatcher():
    """``pyproject.toml``'s ``lightning-twod`` names ``cli.main:main`` (what ``python -m lightning_twod`` runs)."""
    import importlib

    import tomllib

    import lightning_twod.__main__

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["lightning-twod"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is main is lightning_twod.__main__.main


def test_batch_size_of_looks_where_lightning_looks():
    class Holder:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    assert batch_size_of(Holder(), Holder(batch_size=32)) == 32
    assert batch_size_of(Holder(hparams=Holder(batch_size=16)), Holder(batch_size=32)) == 16
    assert batch_size_of(Holder(batch_size=True), None) == DEFAULT_PLANNER_BATCH


def test_plan_shows_a_table_in_groups_of_its_own_size_and_saves_it(config, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    own = "--trainer.strategy.init_args.sharding={t_cat_0: {type: row_wise, shard_group_size: 4}}"
    assert plan_main(["--config", str(config), "--trainer.devices=4", "--trainer.strategy.init_args.shard_group_size=2",
                      own, "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tables in groups of their own size: t_cat_0: 4" in text
    assert "sparse.t_cat_0: row_wise on [0, 1, 2, 3] of each group of 4 (1 copy)" in text
    assert "per-rank memory of a per-table layout" in text and "1D (1 x 4)" not in text
    plan = ShardingPlan.load(out)
    assert plan.modules["sparse"]["t_cat_0"].group_size == 4 and plan.shard_group_size == 2
    assert plan.modules["sparse"]["t_cat_1"].group_size is None


@pytest.mark.parametrize("command", ["fit", "plan"])
def test_a_mesh_the_devices_cannot_form_is_one_message_before_any_process_starts(config, capsys, command):
    with pytest.raises(SystemExit) as exited:  # the unit tier fails a test that starts a process
        main([command, "--config", str(config), "--trainer.devices=3",
              "--trainer.strategy.init_args.shard_group_size=2"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert f"lightning-twod {command}: error: TwoDSparseStrategy: shard_group_size=2 does not divide world_size=3; " \
           "choose one of 1, 3 (world_size = num_nodes x devices = 1 x 3)" in err
    assert "Traceback" not in err and err.count("error:") == 1


def _raise(err: BaseException, handling: BaseException | None = None):
    def run():
        if handling is None:
            raise err
        try:
            raise handling
        except type(handling):
            raise err  # noqa: B904 (a bug while handling a user's error: its __context__, not its cause)
    return run


def test_an_error_that_is_not_the_users_keeps_its_traceback(monkeypatch):
    from lightning_twod.cli.errors import run_reporting_errors

    with pytest.raises(KeyError):
        run_reporting_errors("fit", _raise(KeyError("a bug")))
    with pytest.raises(KeyError):  # raised while handling a missing file: still the bug's traceback
        run_reporting_errors("fit", _raise(KeyError("a bug"), FileNotFoundError("x")))
    marked = TypeError("a bug in configure_optimizers")
    marked.raised_on_every_rank = True  # as the consensus marks it: rank 0 keeps the traceback
    with pytest.raises(TypeError):
        run_reporting_errors("fit", _raise(marked))
    monkeypatch.setenv("LIGHTNING_TWOD_TRACEBACK", "1")
    with pytest.raises(MisconfigurationException):
        run_reporting_errors("fit", _raise(MisconfigurationException("bad")))


@pytest.mark.parametrize(("rank", "printed"), [("0", True), ("3", False)])
def test_a_configuration_error_before_any_process_group_is_printed_by_rank_0_alone(monkeypatch, capsys, rank,
                                                                                    printed):
    from lightning_twod.cli.errors import run_reporting_errors

    monkeypatch.setenv("SLURM_PROCID", rank)  # as srun starts task `rank` of 4, before Lightning makes a group
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(SystemExit) as exited:
        run_reporting_errors("fit", _raise(MisconfigurationException("shard_group_size=3 does not divide 4")))
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert ("lightning-twod fit: error: shard_group_size=3 does not divide 4" in err) == printed
    assert "rank " not in err  # the same in every process: no rank to name


def test_plan_shows_every_table_in_full_and_writes_the_same_as_yaml(tmp_path, capsys):
    import yaml

    config = write_config(tmp_path)
    out = tmp_path / "tables.yaml"
    assert plan_main(["--config", str(config), "--trainer.devices=4", "--trainer.strategy.init_args.shard_group_size=2",
                      "--trainer.strategy.init_args.sharding={t_cat_0: {type: row_wise, shard_group_size: 4}}",
                      "--output", str(out)]) == 0
    text = capsys.readouterr().out
    report = yaml.safe_load(out.read_text())
    assert report["group_sizes"] == [2, 4] and report["decision"].startswith("TwoDSparseStrategy: shard_group_size=2")
    tables = {t["table"]: t for t in report["tables"]}
    assert set(tables) == {"t_cat_0", "t_cat_1", "t_cat_2"}
    assert tables["t_cat_0"]["type"] == "row_wise" and tables["t_cat_0"]["group_size"] == 4
    assert tables["t_cat_0"]["copies"] == 1 and tables["t_cat_0"]["ranks"] == [0, 1, 2, 3]
    for name in ("t_cat_1", "t_cat_2"):
        assert tables[name]["group_size"] == 2 and tables[name]["copies"] == 2 and len(tables[name]["ranks"]) == 1
    # of two table-wise tables in the same groups, the one of 900 rows costs its owner more than the one of 60
    assert tables["t_cat_2"]["bytes_per_rank"] > tables["t_cat_1"]["bytes_per_rank"] > 0
    for name, row in tables.items():
        line = next(line for line in text.splitlines() if line.strip().startswith(f"sparse.{name} "))
        assert f" {row['type']} " in line and line.rstrip().endswith(", ".join(map(str, row["ranks"])))


def test_a_bad_strategy_argument_is_its_message_not_the_parsers_traceback(config, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(config), "--trainer.strategy.init_args.sync_interval=0"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "lightning-twod fit: error: TwoDSparseStrategy: sync_interval=0; use an int >= 1" in err
    assert "Traceback" not in err and "Given value" not in err
