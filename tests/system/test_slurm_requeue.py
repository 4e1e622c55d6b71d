"""SLURM's requeue signal under the 2D strategy: two processes started the way ``srun`` starts them
(``SLURM_*`` variables, as ``test_cluster_launch.py``), SIGUSR1 to one rank in the middle of training.

Both ranks save at the same batch end a distributed checkpoint ``hpc_ckpt_1.ckpt`` in
``default_root_dir`` (Lightning's ``hpc_save`` path, through the strategy), rank 0 calls ``scontrol
requeue JOB`` once (a stand-in ``scontrol`` on PATH records it), and the requeued job
(``SLURM_RESTART_COUNT=1``, no ``ckpt_path``) resumes from that checkpoint by Lightning's rule: the
step and weights it starts from are those of the signal. ``examples/slurm/train.sbatch`` resumes a
requeued job from the newest of that checkpoint and ``last.ckpt``, and starts afresh with ``RESUME=0``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.checkpoint import is_distributed_checkpoint
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed
from tests.system.test_cluster_launch import _slurm_port

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 4
SIGNALLED = 1  # rank 0 gets SIGUSR1 in the training step of this batch (0-based): after optimizer step 1
#: With accumulate_grad_batches=2: the first batch of optimizer step 2, whose gradients a save there would drop.
MID_ACCUMULATION = 2
FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_CALLS"\n'


class _SignalAndRecord(pl.Callback):
    """Rank 0 signals itself inside a training step; every rank records the step and weights where
    the requeue handler ran, and those a resumed run starts from."""

    def __init__(self, signalled: int = SIGNALLED) -> None:
        self.records: dict[str, dict] = {}
        self.signalled = signalled

    def on_train_start(self, trainer, pl_module) -> None:
        self.records["start"] = {"step": trainer.global_step, "state": C.numpy_state(pl_module.net.state_dict()),
                                 "ckpt_path": trainer.ckpt_path}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.signalled and trainer.global_rank == 0 and "start" in self.records \
                and self.records["start"]["step"] == 0:
            os.kill(os.getpid(), signal.SIGUSR1)  # noted now; acted on at this batch's end, on every rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == SIGNALLED:  # the state the requeue handler (after this callback) saves
            self.records["signal"] = {"step": trainer.global_step,
                                      "state": C.numpy_state(pl_module.net.state_dict())}  # a collective


def _slurm(rank: int, port: int, restarts: int) -> dict[str, str]:
    env = {"SLURM_NTASKS": str(WORLD), "SLURM_NTASKS_PER_NODE": str(WORLD), "SLURM_NNODES": "1",
           "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
           "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "twod-requeue", "SLURM_JOB_ID": f"9{port - 15000:04d}"}
    return {**env, "SLURM_RESTART_COUNT": str(restarts)} if restarts else env


def _worker(rank: int, world: int, port: int, root: str, restarts: int, accumulate: int = 1) -> dict:
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        os.environ.pop(name)
    os.environ.update(_slurm(rank, port, restarts))
    os.environ.update(PATH=f"{root}/bin:{os.environ['PATH']}", SCONTROL_CALLS=f"{root}/scontrol_calls")
    lit = C.LitDLRM(C.make_net("collection"), 0.2, num_samples=STEPS * world * C.LOCAL_BATCH * accumulate)
    strategy = TwoDSparseStrategy(shard_group_size=1, sparse_lr=0.05)
    record = _SignalAndRecord(SIGNALLED if accumulate == 1 else MID_ACCUMULATION)
    trainer = pl.Trainer(devices=world, strategy=strategy, default_root_dir=f"{root}/run", callbacks=[record],
                         accumulate_grad_batches=accumulate, **C.trainer_kwargs(STEPS))
    trainer.fit(lit)  # no ckpt_path: a requeued job resumes by Lightning's rule
    return {**record.records, "steps": trainer.global_step}


def _run(root: Path, restarts: int, accumulate: int = 1) -> list[dict]:
    port = _slurm_port()
    return run_distributed(_worker, WORLD, port, str(root), restarts, accumulate, timeout=300, init_group=False)


def _fake_scontrol(root: Path) -> None:
    (root / "bin").mkdir()
    (root / "bin" / "scontrol").write_text(FAKE_SCONTROL)
    (root / "bin" / "scontrol").chmod(0o755)


@pytest.fixture(scope="module")
def requeued(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    root = tmp_path_factory.mktemp("requeue")
    _fake_scontrol(root)
    first = _run(root, 0)
    return root, first, _run(root, 1)


def test_the_signal_saves_a_distributed_checkpoint_at_one_batch_end_and_requeues_once(requeued):
    root, first, _ = requeued
    saved = root / "run" / "hpc_ckpt_1.ckpt"
    assert is_distributed_checkpoint(saved) and (saved / "COMPLETE").exists()
    assert sorted(p.name for p in (root / "run").iterdir()) == ["hpc_ckpt_1.ckpt"], "one save, nothing partial"
    calls = (root / "scontrol_calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("requeue 9"), calls
    assert [r["steps"] for r in first] == [STEPS, STEPS], "the stand-in scontrol requeues nothing: training goes on"
    assert [r["signal"]["step"] for r in first] == [SIGNALLED + 1] * WORLD


def test_the_requeued_job_resumes_from_the_state_saved_at_the_signal(requeued):
    root, first, resumed = requeued
    for before, after in zip(first, resumed, strict=True):
        assert after["start"]["ckpt_path"] == str(root / "run" / "hpc_ckpt_1.ckpt")
        assert after["start"]["step"] == SIGNALLED + 1
        for key, value in before["signal"]["state"].items():
            assert (after["start"]["state"][key] == value).all(), key
        assert after["steps"] == STEPS


def test_a_signal_in_the_middle_of_a_gradient_accumulation_is_acted_on_after_its_optimizer_step(tmp_path):
    """With ``accumulate_grad_batches=2`` and the signal in the first batch of step 2, the save waits
    for that step's second batch: a save in between would drop the gradients accumulated so far."""
    _fake_scontrol(tmp_path)
    ranks = _run(tmp_path, 0, accumulate=2)
    assert [r["steps"] for r in ranks] == [STEPS, STEPS]
    saved = torch.load(tmp_path / "run" / "hpc_ckpt_1.ckpt" / "trainer_state.pt", weights_only=True)
    assert saved["global_step"] == 2, "the requeue saved in the middle of an accumulation"
    # saved at the end of batch MID_ACCUMULATION + 1, the step's last: processed, not yet completed
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == MID_ACCUMULATION + 2


def _script(tmp_path: Path, env: dict[str, str]) -> list[str]:
    """Run examples/slurm/train.sbatch with stand-ins for srun, scontrol and python; the fit line it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, body in {"srun": 'echo "srun $*" >> calls', "scontrol": "echo node0", "python": 'echo "python $*" >> calls'}.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    (tmp_path / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    (tmp_path / "calls").unlink(missing_ok=True)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "8",
             "SLURM_JOB_NODELIST": "node[0-1]"}
    done = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "train.sbatch")], cwd=tmp_path, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **slurm, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    fit = [line for line in (tmp_path / "calls").read_text().splitlines() if " fit " in line]
    assert len(fit) == 1
    return fit[0].split()


def _ckpt_path(args: list[str]) -> str | None:
    return args[args.index("--ckpt_path") + 1] if "--ckpt_path" in args else None


def test_the_slurm_script_resumes_a_requeued_job_from_the_newest_of_the_signal_s_and_last(tmp_path):
    run, last = tmp_path / "runs" / "slurm-4242", tmp_path / "checkpoints" / "slurm_criteo"
    args = _script(tmp_path, {})
    assert _ckpt_path(args) is None, "a new job starts afresh"
    assert args[args.index("--trainer.default_root_dir") + 1] == "runs/slurm-4242"
    for folder in (run / "hpc_ckpt_1.ckpt", last / "last.ckpt"):
        folder.mkdir(parents=True)
    os.utime(last / "last.ckpt", (1, 1))  # older than the signal's
    assert _ckpt_path(_script(tmp_path, {"SLURM_RESTART_COUNT": "1"})) == "runs/slurm-4242/hpc_ckpt_1.ckpt"
    assert _ckpt_path(_script(tmp_path, {"SLURM_RESTART_COUNT": "1", "RESUME": "0"})) == \
        "runs/slurm-4242/hpc_ckpt_1.ckpt", "a requeued job always resumes"
    os.utime(run / "hpc_ckpt_1.ckpt", (0, 0))  # now last.ckpt is newer
    assert _ckpt_path(_script(tmp_path, {"SLURM_RESTART_COUNT": "1"})) == "checkpoints/slurm_criteo/last.ckpt"
    assert _ckpt_path(_script(tmp_path, {"RESUME": "1"})) == "checkpoints/slurm_criteo/last.ckpt"
    assert _ckpt_path(_script(tmp_path, {"RESUME": "0"})) is None
