"""The strategy under real launchers, in subprocesses (never Lightning's launcher inside pytest):
Lightning's subprocess launcher from a script, LightningCLI with a strategy name and with a
class_path config, and a two-node torchrun launch on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "scripts" / "train_tiny.py"
TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def _torchrun_two_nodes(tmp_path: Path, placement: str) -> dict:
    """Two torchrun launches of 2 processes each (node ranks 0 and 1) that form one job.

    Both nodes are watched together: when one fails, the other would wait in torchrun's exit
    barrier for minutes, so the survivor is stopped at once and both logs go into the failure message.
    """
    out, port = tmp_path / f"two_nodes_{placement}.pt", _free_port()
    logs = [tmp_path / f"torchrun_{placement}_node{node}.log" for node in (0, 1)]
    sinks = [log.open("w") for log in logs]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPT),
             "--out", str(out), "--devices", "2", "--num-nodes", "2", "--strategy", "object",
             "--placement", placement, "--shard-group-size", "2"],
            cwd=tmp_path, env=child_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )
        for node, sink in zip((0, 1), sinks)
    ]
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in procs]
            if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes):
                break
            time.sleep(0.5)
    finally:
        for proc in procs:  # the agent and its workers: a failed node leaves no process behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for sink in sinks:
            sink.close()
    codes = [proc.returncode for proc in procs]
    if codes != [0, 0]:
        text = "\n".join(f"--- node {node} (exit code {code}):\n{log.read_text()[-5000:]}"
                         for node, (code, log) in enumerate(zip(codes, logs)))
        pytest.fail(f"a torchrun node failed or ran past {TIMEOUT} s:\n{text}")
    return torch.load(out, weights_only=False)


def test_two_node_torchrun_matches_single_node(tmp_path):
    single = tmp_path / "single.pt"
    _run([sys.executable, str(SCRIPT), "--out", str(single), "--devices", "4", "--strategy", "object",
          "--shard-group-size", "4"], tmp_path)
    reference = torch.load(single, weights_only=False)
    assert reference["shard_groups"] == [[0, 1, 2, 3]]
    assert reference["global_step"] == 8 and reference["sparse_optimizer"] == "sgd"

    contiguous = _torchrun_two_nodes(tmp_path, "contiguous")
    assert contiguous["shard_groups"] == [[0, 1], [2, 3]], "a shard group is one node's ranks"
    strided = _torchrun_two_nodes(tmp_path, "strided")
    assert strided["replica_groups"] == [[0, 1], [2, 3]], "a replica group is one node's ranks"

    for run in (contiguous, strided):
        assert run["global_step"] == 8
        assert run["state_dict"].keys() == reference["state_dict"].keys()
        for key, value in reference["state_dict"].items():
            torch.testing.assert_close(run["state_dict"][key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_cli_strategy_by_name_and_by_class_path(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  max_steps: 3\n  limit_val_batches: 2\n"
        "  enable_progress_bar: false\n  logger: false\n  enable_checkpointing: false\n"
        "model:\n  class_path: lightning_twod.models.dlrm.DLRM\n"
        "  init_args: {table_rows: [100, 60], embedding_dim: 8, bottom_mlp: [8], top_mlp: [8]}\n"
        "data:\n  class_path: lightning_twod.datasets.synthetic.SyntheticDataModule\n"
        "  init_args: {table_rows: [100, 60], num_train: 256, num_val: 64, batch_size: 16}\n"
    )
    by_name = _run([sys.executable, "-m", "lightning_twod", "fit", "--config", str(config),
                    "--trainer.strategy=twod_sparse"], tmp_path)
    text = by_name.stdout + by_name.stderr
    assert "args parameter" not in text  # the CLI reads the command line itself
    # "auto": both layouts fit; the planner lists them with predicted times and builds the one it starred
    chosen = re.search(r"TwoDSparseStrategy: shard_group_size=(\d), placement=contiguous \((\d) replica group", text)
    assert chosen, text[-3000:]
    assert "S=1 contiguous: " in text and "S=2 contiguous: " in text and "candidates (predicted ms" in text
    assert f"* S={chosen[1]} contiguous: " in text
    assert f"TwoDSparseStrategy: {chosen[2]} replica group(s) x {chosen[1]} rank(s) per shard group" in text

    class_path = _run([sys.executable, "-m", "lightning_twod", "fit", "--config", str(config),
                       "--trainer.strategy=lightning_twod.TwoDSparseStrategy",
                       "--trainer.strategy.shard_group_size=1", "--trainer.strategy.sync_interval=2",
                       "--trainer.strategy.sparse_optimizer=momentum_rowwise_adagrad"], tmp_path)
    text = class_path.stdout + class_path.stderr
    assert "2 replica group(s) x 1 rank(s)" in text and "sync_interval=2" in text
    assert "momentum_scale=2.0" in text

    bad = subprocess.run([sys.executable, "-m", "lightning_twod", "fit", "--config", str(config),
                          "--trainer.strategy=lightning_twod.TwoDSparseStrategy",
                          "--trainer.strategy.sync_mode=sometimes"],
                         cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode != 0 and "sync_mode" in bad.stderr


@pytest.mark.parametrize("config", sorted((ROOT / "examples" / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_configs_run_briefly_quietly_and_resume_from_last(config, tmp_path):
    fit = [sys.executable, "-m", "lightning_twod", "fit", "--config", str(config), "--trainer.limit_val_batches=1",
           "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false"]
    done = _run([*fit, "--trainer.max_steps=2"], tmp_path)
    assert "epoch 0 step 2: val_auc" in done.stdout, "the model reports validation AUC and NE"
    text = done.stdout + done.stderr
    for noise in ("Warning", "LeafSpec", "Tip:", "dirpath has changed"):  # nothing the user cannot act on
        assert noise not in text, text[-4000:]
    assert (tmp_path / "checkpoints" / config.stem / "last.ckpt").exists()
    # the documented resume command: from last.ckpt of the config's own folder, on to step 4
    again = _run([*fit, "--trainer.max_steps=4", "--ckpt_path", "last"], tmp_path)
    last = tmp_path / "checkpoints" / config.stem / "last.ckpt"
    assert f"Restored all states from the checkpoint at {last}" in again.stdout + again.stderr
    assert "epoch 0 step 4: val_auc" in again.stdout and "epoch 0 step 2: val_auc" not in again.stdout


def test_fabric_example_runs_under_fabrics_launcher_and_torchrun(tmp_path):
    script = str(ROOT / "examples" / "fabric_dlrm.py")
    args = ["--epochs", "1", "--max-steps", "4", "--devices", "2", "--shard-group-size", "1", "--batch-size", "128"]
    for cmd in ([sys.executable, script, *args],
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", script, *args]):
        done = _run(cmd, tmp_path)
        assert "epoch 0 step 4: val_auc" in done.stdout, done.stdout[-2000:]
        assert "TwoDSparseFabricStrategy: 2 replica group(s) x 1 rank(s)" in done.stdout + done.stderr
        assert "batch 128 per rank" in done.stdout + done.stderr, "planned for the loaders' batch"
        assert "Warning" not in done.stderr, done.stderr[-3000:]  # the loss is read detached: no autograd warning


def test_demo_main_job_runs(tmp_path):
    done = _run([sys.executable, "-m", "lightning_twod", "demo", "--steps", "8", "--rows", "200"], tmp_path)
    assert "sharding plan" in done.stdout + done.stderr
    assert "train loss" in done.stdout and "bytes sent per training step" in done.stdout + done.stderr


def test_version_from_the_command_line(tmp_path):
    import lightning_twod

    done = subprocess.run([sys.executable, "-m", "lightning_twod", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"lightning-twod {lightning_twod.__version__}"
