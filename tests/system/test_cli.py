"""One LightningCLI parser for fit/validate/test/predict and plan: the data's table sizes linked
into the model, ``plan`` printing what ``fit`` logs (same batch, same options), ``prog`` and no
``args`` warning. The fit runs go through a subprocess (Lightning's own launcher runs there, never
inside pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_twod.cli.main import main
from lightning_twod.cli.plan import plan_main
from lightning_twod.integration.engine import DEFAULT_PLANNER_BATCH, batch_size_of
from lightning_twod.planner import ShardingPlan
from lightning_twod.core.shards import ShardingType

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300
CONFIG = (
    "seed_everything: 0\ntrainer:\n  accelerator: cpu\n  devices: 2\n  max_steps: 2\n  limit_val_batches: 1\n"
    "  enable_progress_bar: false\n  logger: false\n  enable_checkpointing: false\n"
    "  strategy:\n    class_path: lightning_twod.TwoDSparseStrategy\n"
    "    init_args: {links: h100, sync_interval: 2, sharding: {t_cat_0: row_wise}}\n"
    "model:\n  class_path: lightning_twod.models.dlrm.DLRM\n"
    "  init_args: {embedding_dim: 8, bottom_mlp: [8], top_mlp: [8]}\n"
    "data:\n  class_path: lightning_twod.datasets.synthetic.SyntheticDataModule\n"
    "  init_args: {table_rows: [3000, 60, 900], num_dense: 5, num_train: 256, num_val: 64, batch_size: 48}\n"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_twod", *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    return path


def _planner_lines(text: str) -> list[str]:
    """The lines set-up logs about the plan: the choice, the backend and the plan table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("TwoDSparseStrategy: shard_group_size="))
    table = next(i for i, line in enumerate(lines) if line.startswith("sharding plan:"))
    end = next(i for i in range(table + 1, len(lines)) if not lines[i].startswith("  "))
    backend = next(line for line in lines if line.startswith("kernel backend:"))
    return [lines[start], backend, *lines[table:end]]


def test_plan_prints_exactly_what_fit_logs(config, tmp_path):
    overrides = ["--trainer.strategy.init_args.placement=auto", "--data.init_args.batch_size=40"]
    planned = _cli(tmp_path, "plan", "--config", str(config), *overrides)
    assert planned.returncode == 0, planned.stderr[-3000:]
    fitted = _cli(tmp_path, "fit", "--config", str(config), *overrides)
    assert fitted.returncode == 0, fitted.stderr[-5000:]
    fit_text = fitted.stdout + fitted.stderr
    expected = _planner_lines(planned.stdout)
    assert "batch 40 per rank" in "\n".join(expected), "the plan is made for the data's batch"
    assert "sync every 2 step(s)" in expected[0] and "candidates (predicted ms" in planned.stdout
    got = _planner_lines(fit_text)
    assert got == expected
    assert "args parameter" not in fit_text and "args parameter" not in planned.stdout + planned.stderr


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


def _layout_line(text: str) -> str:
    """The layout of the plan line: ``shard_group_size=S, placement=P (M replica group(s) x S rank(s))``."""
    line = next(line for line in text.splitlines() if line.startswith("TwoDSparseStrategy: shard_group_size="))
    return line.split(": ")[1]


def test_plan_measures_this_machine_where_fit_measures(config, capsys):
    assert plan_main(["--config", str(config), "--trainer.strategy.init_args.links=auto"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("note: measured here on 2 processes, as fit does at set-up")
    assert "links: measured (measured on 2 ranks, the median of 3 probes" in text
    assert "h100" not in text and "a100" not in text  # a CPU machine is never planned as a GPU preset
    assert plan_main(["--config", str(config), "--trainer.strategy.init_args.links=auto",
                      "--trainer.strategy.init_args.shard_group_size=2"]) == 0
    pinned = capsys.readouterr().out
    assert "links: unmeasured (nothing measured" in pinned and "h100" not in pinned  # fit measures nothing either


def test_plan_and_fit_choose_the_same_layout_on_the_same_machine(config, tmp_path):
    overrides = ["--trainer.strategy.init_args.links=auto", "--trainer.strategy.init_args.placement=auto",
                 "--trainer.devices=2"]
    planned = _cli(tmp_path, "plan", "--config", str(config), *overrides)
    assert planned.returncode == 0, planned.stderr[-3000:]
    fitted = _cli(tmp_path, "fit", "--config", str(config), *overrides)
    assert fitted.returncode == 0, fitted.stderr[-5000:]
    fit_text = fitted.stdout + fitted.stderr
    print(f"plan: {planned.stdout}\nfit: {fit_text}")
    assert "links: measured" in planned.stdout and "links: measured" in fit_text
    assert _layout_line(planned.stdout) == _layout_line(fit_text)


def test_table_rows_come_from_the_data_and_a_different_model_value_is_refused(config, capsys):
    with pytest.raises(ValueError, match=r"model.init_args.table_rows=\[7, 7\] disagrees with the data's "
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


def test_help_imports_neither_torch_nor_lightning():
    """``--version``, ``--help`` and ``consolidate --help`` in a fresh interpreter (this one has torch)."""
    code = ("import sys\nfrom lightning_twod.cli.main import main\n"
            "for argv in (['--version'], ['--help'], ['consolidate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as exited:\n        assert exited.code == 0, argv\n"
            "heavy = sorted(m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: python -m lightning_twod consolidate" in done.stdout


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
