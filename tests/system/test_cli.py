"""The command line where processes start: ``plan`` printing what ``fit`` logs (same batch, same
options, the same layout on links measured here) and no ``args`` warning, and ``--help`` in a fresh
interpreter importing nothing heavy. The fit runs go through a subprocess (Lightning's own launcher
runs there, never inside pytest). The in-process checks are in ``tests/unit/test_cli.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_twod.cli.plan import plan_main
from tests.helpers.cli_cases import write_config
from tests.helpers.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_twod", *args], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture
def config(tmp_path) -> Path:
    return write_config(tmp_path)


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


def test_plan_and_fit_plan_on_the_same_sampled_lookup_statistics_of_pooled_data(config, tmp_path):
    pooled = ("data:\n  class_path: tests.helpers.pooled_data.PooledDataModule\n"
              "  init_args: {table_rows: [3000, 60, 900], num_dense: 5, num_train: 256, batch_size: 48}\n")
    config.write_text(config.read_text().split("data:\n")[0] + pooled)
    planned = _cli(tmp_path, "plan", "--config", str(config))
    assert planned.returncode == 0, planned.stderr[-3000:]
    fitted = _cli(tmp_path, "fit", "--config", str(config))
    assert fitted.returncode == 0, fitted.stderr[-5000:]
    expected = _planner_lines(planned.stdout)
    assert "; lookup stats: ids per feature " in expected[0]  # bags of 1 to 19 ids
    assert expected[0].endswith("(sampled from the first training batch, 48 samples)")
    assert _planner_lines(fitted.stdout + fitted.stderr) == expected


def _layout_line(text: str) -> str:
    """The layout of the plan line: ``shard_group_size=S, placement=P (M replica group(s) x S rank(s))``."""
    line = next(line for line in text.splitlines() if line.startswith("TwoDSparseStrategy: shard_group_size="))
    return line.split(": ")[1]


def test_plan_measures_this_machine_where_fit_measures(config, capsys):
    assert plan_main(["--config", str(config), "--trainer.strategy.init_args.links=auto"]) == 0
    text = capsys.readouterr().out
    said, note = text.splitlines()[:2]
    assert said.startswith("measuring the links on 2 processes started here, as fit does at set-up with "
                           "links='auto' and a layout chosen by cost: no entry for 2 ranks, 2 per node")
    assert said.endswith("(--links FILE from `lightning-twod calibrate`, or a preset, plans without starting "
                         "processes) ...")  # before they start
    assert note.startswith("note: measured here on 2 processes, as fit does at set-up; kept in the links cache")
    assert "links: measured (measured on 2 ranks, the fastest of 3 probes" in text
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
    assert "kept in the links cache" in planned.stdout and "from the links cache" in fit_text  # no probe in fit
    assert _layout_line(planned.stdout) == _layout_line(fit_text)


def test_help_imports_neither_torch_nor_lightning():
    """``--version``, ``--help`` and ``consolidate --help`` in a fresh interpreter (this one has torch)."""
    code = ("import sys\nfrom lightning_twod.cli.main import main\n"
            "for argv in (['--version'], ['--help'], ['consolidate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as exited:\n        assert exited.code == 0, argv\n"
            "heavy = sorted(m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: python -m lightning_twod consolidate" in done.stdout


def test_an_error_every_rank_raises_is_printed_once_without_tracebacks(config, tmp_path):
    # a sharding entry for a table the model does not have: found in the launching process, before any worker
    fitted = _cli(tmp_path, "fit", "--config", str(config), "--trainer.strategy.init_args.sharding={nope: row_wise}")
    assert fitted.returncode != 0
    assert "All distributed processes registered" not in fitted.stdout + fitted.stderr, fitted.stderr[-3000:]
    errors = [line for line in fitted.stderr.splitlines() if "error:" in line]
    assert errors == ["lightning-twod fit: error: TwoDSparseStrategy: sharding names unknown tables ['nope']; the "
                      "model's tables are ['t_cat_0', 't_cat_1', 't_cat_2']"], fitted.stderr[-3000:]
    assert "Traceback" not in fitted.stderr, fitted.stderr[-3000:]


@pytest.mark.parametrize("index", [4, 5], ids=["rank0", "rank1"])  # line i is rank i % 2's
def test_a_bad_row_on_one_rank_is_one_message_naming_the_rank_file_and_line(tmp_path, index):
    from tests.helpers.criteo_cases import BAD, ROWS, criteo_lines, write

    lines = criteo_lines(200)
    lines[index] = BAD[1][0]
    write(tmp_path / "train.tsv", lines)
    (tmp_path / "criteo.yaml").write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  max_steps: 5\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n  limit_val_batches: 0\n"
        "  strategy:\n    class_path: lightning_twod.TwoDSparseStrategy\n    init_args: {shard_group_size: 2, links: h100}\n"
        "model:\n  class_path: lightning_twod.models.DLRM\n  init_args: {embedding_dim: 8, bottom_mlp: [8], top_mlp: [8]}\n"
        f"data:\n  class_path: lightning_twod.datasets.CriteoDataModule\n"
        f"  init_args: {{train_path: train.tsv, table_rows: {ROWS}, batch_size: 16}}\n")
    fitted = _cli(tmp_path, "fit", "--config", "criteo.yaml")
    assert fitted.returncode != 0
    errors = [line for line in fitted.stderr.splitlines() if "error:" in line]
    assert errors == [f"lightning-twod fit: error: rank {index % 2}: train.tsv:{index + 1}: column 4 (I3) is 'x7', "
                      "not an integer; pass bad_rows='skip' to skip and count such rows"], fitted.stderr[-3000:]
    assert "Traceback" not in fitted.stderr, fitted.stderr[-3000:]
