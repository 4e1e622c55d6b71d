"""Distributed checkpoints of ``TwoDSparseStrategy``: exact resume, resharding, export, atomicity, faults.

The model (``checkpoint_cases``): a small DLRM with Adam on the dense part, row-wise AdaGrad on
the tables, and one table of each layout (column-wise, row-wise, table-wise). Every run happens in
children that pose as externally launched ranks (``checkpoint_cases.run_ranks``: ``run_distributed``
on a preloaded forkserver); each run carries out several fits, and the tests compare what the runs
reported and what they left on disk:

* ``mesh_2x2`` (4 processes): uninterrupted 2 epochs; 1 epoch + save ``e1``; resume for epoch 2;
  then ``e1`` loaded and saved again at once on 1x4 and 4x1, and the 1x4 copy back on 2x2; the same
  on 1x4 for ``format1_2x2``, a 2x2 checkpoint of format 1 (``ShardedTensor``, ``K.FORMAT1``);
* ``single`` (1 process): the same resume check, ``e1`` and ``format1_2x2`` loaded and saved again
  on 1 process;
* ``mesh_2x4`` (8 processes): ``e1`` loaded and saved again on 2x4 (torch kernels);
* ``broken_save``: rank 1 dies while writing the second checkpoint to the path of the first;
* ``dead_rank``: rank 2 dies in the middle of epoch 2 (``ModelCheckpoint`` saved epoch 1);
* ``hung_rank``: rank 2 stops answering in the middle of epoch 2 (the others must time out);
* ``after_faults`` (4 fresh processes): resumes from what those two left behind, and loads the
  1-process checkpoint on 2x2.

Checkpoints are compared with ``consolidate`` and by reading every tensor of the directories
(``checkpoint_cases.read_checkpoint``), on this (pytest) process. Every reload-and-save records the
warnings that its save and a load emitted: there must be none (torch's ``ShardedTensor`` deprecation
warning above all).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_twod.checkpoint import consolidate
from lightning_twod.checkpoint.directory import COMPLETE, IncompleteCheckpointError
from lightning_twod.checkpoint.format import FORMAT, SafeFileSystemReader
from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C

FAULT_TIMEOUT = 20.0  # TwoDSparseStrategy(timeout=...) of the runs with a dead rank
DOOMED_SAVER = 1  # dies inside the second save
DOOMED_TRAINER = 2  # dies at step KILL_STEP
KILL_STEP = 6  # the third step of epoch 2
HANG_TIMEOUT = 5.0  # TwoDSparseStrategy(timeout=...) of the run with a hung rank
DATA_PARALLEL = {**K.SHARDING, "t_cat": "data_parallel"}


# ----------------------------------------------------------------------------- helpers
def dir_digest(path: Path) -> dict[str, str]:
    """``{file name: sha256}`` of a checkpoint directory."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(path).iterdir())}


def assert_equal_arrays(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    for key, value in want.items():
        a, b = np.asarray(got[key]), np.asarray(value)
        assert a.shape == b.shape and np.array_equal(a, b), (
            f"{what}: {key} differs (max |difference| {np.abs(a.astype(float) - b.astype(float)).max():.3g})")


def assert_same_training_state(got: dict, want: dict, what: str) -> None:
    """Bit-identical tables + dense weights, dense optimizer state and sparse AdaGrad states."""
    assert got["global_step"] == want["global_step"], what
    assert_equal_arrays(got["model"], want["model"], f"{what}, model")
    assert_equal_arrays(got["dense_optimizer"], want["dense_optimizer"], f"{what}, dense optimizer")
    assert got["dense_param_groups"] == want["dense_param_groups"], what
    assert_equal_arrays(got["sparse_states"], want["sparse_states"], f"{what}, sparse optimizer")


def accumulator_ratio(source: Path, target: Path, key: str) -> float:
    """``c_target / c_source`` of a table's AdaGrad accumulator (``layout.json``'s ``accumulator_scales``;
    a checkpoint without them, as format 1's, loads it as saved): a load multiplies the state by it."""
    scales = [json.loads((path / "layout.json").read_text()).get("accumulator_scales") for path in (source, target)]
    return 1.0 if scales[0] is None else scales[1][key] / scales[0][key]


def assert_moved(after: dict, before: dict) -> None:
    """Epoch 2 changed every table, the dense weights and the optimizer states (so equality above is not vacuous)."""
    for key in K.TABLE_KEYS + ["net.bottom.weight", "net.top.weight"]:
        assert not np.array_equal(after["model"][key], before["model"][key]), f"{key} did not train"
    for part in ("dense_optimizer", "sparse_states"):
        assert after[part] and any(not np.array_equal(after[part][k], before[part][k]) for k in before[part]), part


# ----------------------------------------------------------------------------- workers
def _single_worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    out = {"uninterrupted": K.snapshot(*K.fit(1, 1, K.EPOCHS))}
    out["epoch1"] = K.snapshot(*K.fit(1, 1, 1, callbacks=[K.SaveAtEpochEnd(f"{root}/single_e1")]))
    trainer, lit, strategy = K.fit(1, 1, K.EPOCHS, ckpt_path=f"{root}/single_e1")
    out["resumed"] = K.snapshot(trainer, lit, strategy)
    out["resumed_seen"] = lit.seen
    out["reshard"] = {"2x2 -> 1 process": K.reshard(1, 1, f"{root}/e1", f"{root}/e1_single"),
                      "format 1: 2x2 -> 1 process": K.reshard(1, 1, f"{root}/format1_2x2", f"{root}/format1_single")}
    return out


def _mesh_2x2_worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    out = {"uninterrupted": K.snapshot(*K.fit(world, 2, K.EPOCHS))}
    out["epoch1"] = K.snapshot(*K.fit(world, 2, 1, callbacks=[K.SaveAtEpochEnd(f"{root}/e1")]))
    trainer, lit, strategy = K.fit(world, 2, K.EPOCHS, ckpt_path=f"{root}/e1")
    out["resumed"] = K.snapshot(trainer, lit, strategy)
    out["resumed_seen"] = lit.seen
    out["reshard"] = {
        "2x2 -> 1x4": K.reshard(world, 4, f"{root}/e1", f"{root}/e1_1x4"),
        "2x2 -> 4x1": K.reshard(world, 1, f"{root}/e1", f"{root}/e1_4x1"),
        "1x4 -> 2x2": K.reshard(world, 2, f"{root}/e1_1x4", f"{root}/e1_1x4_2x2"),
        "format 1: 2x2 -> 1x4": K.reshard(world, 4, f"{root}/format1_2x2", f"{root}/format1_1x4"),
    }
    # a data-parallel table (a full copy on every rank, written by rank 0 alone), 2x2 -> 1x4
    K.fit(world, 2, 1, callbacks=[K.SaveAtEpochEnd(f"{root}/dp")], sharding=DATA_PARALLEL)
    out["reshard"]["data-parallel 2x2 -> 1x4"] = K.reshard(world, 4, f"{root}/dp", f"{root}/dp_1x4",
                                                           sharding=DATA_PARALLEL)
    return out


def _mesh_2x4_worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    # torch kernels: the row-wise AdaGrad state that FBGEMM's TBE kept on 2x2 goes into the other backend
    return {"reshard": {"2x2 -> 2x4": K.reshard(world, 4, f"{root}/e1", f"{root}/e1_2x4", kernel_backend="torch")}}


class _SaveEveryEpoch(Callback):
    """Saves to one path at every epoch end; records the model and the time of each save."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.after_first: dict | None = None
        self.digest: dict | None = None
        self.started: float | None = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.started = time.monotonic()
        trainer.save_checkpoint(self.path)
        if self.after_first is None:
            self.after_first = C.numpy_state(pl_module.state_dict())  # a collective: every rank
            self.digest = dir_digest(Path(self.path))


def _broken_save_worker(rank: int, world: int, port: int, path: str) -> dict:
    """Epoch 1 saves ``path``; in epoch 2's save to the same path rank 1 dies after writing its data."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import lightning_twod.checkpoint.distributed as ckpt

    C.as_external_rank(rank, world, port)
    K.leave_process_group()
    real_save, real_write = ckpt.dcp.save, dcp_fs.FileSystemWriter.write_data
    saves = 0

    def write_then_die(self, plan, planner):
        written = real_write(self, plan, planner)
        written.wait()  # this rank's data file is complete; the save as a whole is not
        os._exit(1)

    def save(*args, **kwargs):
        nonlocal saves
        saves += 1
        if saves == 2 and rank == DOOMED_SAVER:
            dcp_fs.FileSystemWriter.write_data = write_then_die
        return real_save(*args, **kwargs)

    ckpt.dcp.save = save
    saver = _SaveEveryEpoch(path)
    try:
        K.fit(world, 2, K.EPOCHS, callbacks=[saver], timeout=FAULT_TIMEOUT)
        error = None
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent checks it
        error = (type(exc).__name__, str(exc)[:500], time.monotonic() - (saver.started or 0.0))
    finally:
        ckpt.dcp.save = real_save
    return {"error": error, "saves": saves, "after_first": saver.after_first, "digest": saver.digest}


class _KillAt(Callback):
    """Rank ``rank`` ends itself with ``os._exit(1)`` at the start of step ``step``; every rank notes the time."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step, self.started = rank, step, None
        self.timeouts: dict[str, float] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        groups = trainer.strategy.mesh_groups
        for name in ("world", "shard", "replica"):
            backend = getattr(groups, name)._get_backend(torch.device("cpu"))
            self.timeouts[name] = backend.options._timeout.total_seconds()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.started = time.monotonic()
            if trainer.global_rank == self.rank:
                os._exit(1)


def _dead_rank_worker(rank: int, world: int, port: int, dirpath: str) -> dict:
    C.as_external_rank(rank, world, port)
    K.leave_process_group()
    kill = _KillAt(DOOMED_TRAINER, KILL_STEP)
    saver = ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1)
    try:
        K.fit(world, 2, K.EPOCHS, callbacks=[kill, saver], checkpointing=True, timeout=FAULT_TIMEOUT)
        error = None
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent checks it
        error = (type(exc).__name__, str(exc)[:500], time.monotonic() - (kill.started or 0.0))
    return {"error": error, "timeouts": kill.timeouts}


class _HangAt(Callback):
    """Rank ``rank`` stops answering at the start of step ``step`` (it sleeps until every other rank
    has left a file in ``flags``, then ends itself); every rank notes the time."""

    def __init__(self, rank: int, step: int, flags: str) -> None:
        self.rank, self.step, self.flags, self.started = rank, step, Path(flags), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.started = time.monotonic()
            if trainer.global_rank == self.rank:
                deadline = time.monotonic() + 120
                while len(list(self.flags.iterdir())) < trainer.world_size - 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
                os._exit(1)


def _hung_rank_worker(rank: int, world: int, port: int, flags: str) -> dict:
    C.as_external_rank(rank, world, port)
    K.leave_process_group()
    hang = _HangAt(DOOMED_TRAINER, KILL_STEP, flags)
    try:
        K.fit(world, 2, K.EPOCHS, callbacks=[hang], timeout=HANG_TIMEOUT)
        error = None
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent checks it
        error = (type(exc).__name__, str(exc)[:500], time.monotonic() - (hang.started or 0.0))
    (Path(flags) / str(rank)).touch()
    # stay until every survivor has given up: one that exited first would close its connections,
    # and the others would see that instead of their own timeout
    deadline = time.monotonic() + 60
    while len(list(Path(flags).iterdir())) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"error": error}


def _after_faults_worker(rank: int, world: int, port: int, root: str, resume_from: str, earlier: str,
                         partial: str) -> dict:
    C.as_external_rank(rank, world, port)
    trainer, lit, strategy = K.fit(world, 2, K.EPOCHS, ckpt_path=resume_from)
    out = {"resumed": K.snapshot(trainer, lit, strategy), "resumed_seen": lit.seen}
    trainer, lit, strategy = K.fit(world, 2, 1, ckpt_path=earlier)
    out["earlier"] = {"model": C.numpy_state(lit.state_dict()), "global_step": trainer.global_step,
                      "seen": len(lit.seen)}
    out["reshard"] = {"1 process -> 2x2": K.reshard(world, 2, f"{root}/single_e1", f"{root}/single_e1_2x2")}
    try:
        K.fit(world, 2, K.EPOCHS, ckpt_path=partial)
        out["partial"] = None
    except Exception as exc:  # noqa: BLE001 - whatever it is, the parent checks it
        out["partial"] = (type(exc).__name__, str(exc), traceback.format_exc()[-1500:])
    return out


# ----------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def _timed(name: str, fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    print(f"{name}: {time.perf_counter() - start:.1f}s")
    return result


@pytest.fixture(scope="module")
def format1(root) -> Path:
    """A copy of the format 1 checkpoint in ``root``, so that the runs find it beside the others."""
    return Path(shutil.copytree(K.FORMAT1, root / "format1_2x2"))


@pytest.fixture(scope="module")
def mesh_2x2(root, format1) -> list[dict]:
    return _timed("mesh_2x2", K.run_ranks, _mesh_2x2_worker, 4, C.free_port(), str(root), timeout=300)


@pytest.fixture(scope="module")
def single(root, mesh_2x2, format1) -> list[dict]:
    return _timed("single", K.run_ranks, _single_worker, 1, C.free_port(), str(root), timeout=180)


@pytest.fixture(scope="module")
def mesh_2x4(root, mesh_2x2) -> list[dict]:
    return _timed("mesh_2x4", K.run_ranks, _mesh_2x4_worker, 8, C.free_port(), str(root), timeout=300)


@pytest.fixture(scope="module")
def broken_save(root) -> dict:
    results = _timed("broken_save", K.run_ranks, _broken_save_worker, 4, C.free_port(),
                     str(root / "atomic"), dead=DOOMED_SAVER, timeout=3 * FAULT_TIMEOUT + 60)
    return results


@pytest.fixture(scope="module")
def dead_rank(root) -> dict:
    return _timed("dead_rank", K.run_ranks, _dead_rank_worker, 4, C.free_port(), str(root / "fault"),
                  dead=DOOMED_TRAINER, timeout=3 * FAULT_TIMEOUT + 60)


@pytest.fixture(scope="module")
def hung_rank(root) -> dict:
    (root / "flags").mkdir()
    return _timed("hung_rank", K.run_ranks, _hung_rank_worker, 4, C.free_port(), str(root / "flags"),
                  dead=DOOMED_TRAINER, timeout=3 * HANG_TIMEOUT + 60)


@pytest.fixture(scope="module")
def after_faults(root, broken_save, dead_rank, single) -> list[dict]:
    partials = sorted(root.glob(".twod-partial-*"))
    assert len(partials) == 1, f"expected one partial directory of the broken save, found {partials}"
    return _timed("after_faults", K.run_ranks, _after_faults_worker, 4, C.free_port(), str(root),
                  str(root / "fault" / "epoch=0-step=4.ckpt"), str(root / "atomic"), str(partials[0]), timeout=240)


# ----------------------------------------------------------------------------- 1. exact resume
def test_resume_on_one_process_is_bit_exact(single):
    single = single[0]
    # the resumed fit ran epoch 2 only, and ends where the uninterrupted one does, bit for bit
    assert single["resumed_seen"] == [list(range(s * K.GLOBAL, (s + 1) * K.GLOBAL)) for s in range(K.STEPS_PER_EPOCH)]
    assert single["resumed"]["global_step"] == K.EPOCHS * K.STEPS_PER_EPOCH
    assert_same_training_state(single["resumed"], single["uninterrupted"], "1 process")
    assert_moved(single["uninterrupted"], single["epoch1"])


def test_resume_on_2x2_is_bit_exact(mesh_2x2):
    """Weights, Adam state and every rank's AdaGrad accumulators equal the uninterrupted run's exactly
    (this needs the strategy's fixed DDP gradient buckets: see ``TwoDSparseStrategy._fix_gradient_buckets``)."""
    for rank, result in enumerate(mesh_2x2):
        assert len(result["resumed_seen"]) == K.STEPS_PER_EPOCH
        assert result["resumed"]["global_step"] == K.EPOCHS * K.STEPS_PER_EPOCH
        assert_same_training_state(result["resumed"], result["uninterrupted"], f"2x2, rank {rank}")
        assert_moved(result["uninterrupted"], result["epoch1"])


def test_checkpoint_directory_layout(root, mesh_2x2):
    path = root / "e1"
    names = {p.name for p in path.iterdir()}
    assert {".metadata", "trainer_state.pt", "layout.json", COMPLETE} <= names
    assert any(name.endswith(".distcp") for name in names)
    assert not list(root.glob(".twod-*"))  # nothing left behind: no partial, no old directory
    layout = json.loads((path / "layout.json").read_text())
    assert layout["format"] == FORMAT == "lightning-twod-checkpoint/2"
    assert (layout["world_size"], layout["shard_group_size"]) == (4, 2)
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=True)  # safe loading works
    assert (trainer_state["epoch"], trainer_state["global_step"]) == (0, K.STEPS_PER_EPOCH)
    assert "state_dict" not in trainer_state and trainer_state["optimizer_states"] == []
    tensors = K.read_checkpoint(path)
    # every table once, at its full size, with its row-wise AdaGrad state ([rows]; column-wise: [rows, dim])
    for name, rows, dim, _ in C.TABLES:
        key = f"net.sparse.embedding_bags.{name}.weight"
        assert tensors[f"state_dict.{key}"].shape == (rows, dim)
        state = tensors[f"sparse_optimizer.{key}.momentum"]
        assert state.shape == ((rows, dim) if key == K.COLUMN_WISE else (rows,))
    # the shards of replica group 0 (ranks 0 and 1) hold the tables, one saved chunk per shard
    metadata = SafeFileSystemReader(path).read_metadata()
    for key, saved in metadata.state_dict_metadata.items():
        if key.startswith(("state_dict.net.sparse.", "sparse_optimizer.")):
            files = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == key}
            assert files <= {"__0_0.distcp", "__1_0.distcp"}, (key, files)
            assert sum(chunk.sizes.numel() for chunk in saved.chunks) == saved.size.numel(), key
    shards = {key: len(metadata.state_dict_metadata[f"state_dict.{key}"].chunks) for key in K.TABLE_KEYS}
    assert list(shards.values()) == [2, 2, 1], shards  # column-wise and row-wise in 2 blocks; table-wise whole
    assert {k.split(".")[-1] for k in tensors if k.startswith("optimizer_0.")} == {"step", "exp_avg", "exp_avg_sq"}
    # the content is the model of the run that saved it
    for key, value in mesh_2x2[0]["epoch1"]["model"].items():
        assert torch.equal(tensors[f"state_dict.{key}"], torch.as_tensor(value)), key


# ----------------------------------------------------------------------------- 2. resharding
# name: (run that did it, source, target, shard group size and world size of the target, whether the
# column-wise AdaGrad state comes back exactly: every target column block lies inside one block of
# equal accumulators of the source; else two 4-column blocks of 2x2 merge into one 8-column block)
RESHARDS = {
    "2x2 -> 1x4": ("mesh_2x2", "e1", "e1_1x4", 4, 4, True),
    "2x2 -> 4x1": ("mesh_2x2", "e1", "e1_4x1", 1, 4, False),
    "2x2 -> 2x4": ("mesh_2x4", "e1", "e1_2x4", 4, 8, True),
    "2x2 -> 1 process": ("single", "e1", "e1_single", 1, 1, False),
    "1x4 -> 2x2": ("mesh_2x2", "e1_1x4", "e1_1x4_2x2", 2, 4, True),  # e1_1x4 kept the column blocks of 2x2
    "1 process -> 2x2": ("after_faults", "single_e1", "single_e1_2x2", 2, 4, True),
    "format 1: 2x2 -> 1x4": ("mesh_2x2", "format1_2x2", "format1_1x4", 4, 4, True),
    "format 1: 2x2 -> 1 process": ("single", "format1_2x2", "format1_single", 1, 1, False),
}


@pytest.mark.parametrize("name", list(RESHARDS))
def test_reshard_then_save_keeps_everything(name, root, request):
    """Load on another mesh, save again at once: same tables, dense weights and optimizer states."""
    run, source, target, size, world, exact = RESHARDS[name]
    reports = [result["reshard"][name] for result in request.getfixturevalue(run)]
    assert len(reports) == world
    for report in reports:  # loaded and saved; trained nothing
        assert report["global_step"] == report["saved_step"] == K.STEPS_PER_EPOCH and report["seen"] == 0
    if name == "2x2 -> 2x4":  # the states go from FBGEMM's TBE (2x2, when it imports) into torch kernels
        assert all(report["kernels"] == ["TorchKernel"] for report in reports)
    layout = json.loads((root / target / "layout.json").read_text())
    assert (layout["world_size"], layout["shard_group_size"], layout["format"]) == (world, size, FORMAT)
    # momentum-scaled AdaGrad (the default) divides the accumulators by the number of replica groups
    assert layout["accumulator_scales"] == {key: world // size for key in K.TABLE_KEYS}

    src, dst = K.read_checkpoint(root / source), K.read_checkpoint(root / target)
    assert sorted(dst) == sorted(src)
    column_state = f"sparse_optimizer.{K.COLUMN_WISE}.momentum"
    ratio = {key: accumulator_ratio(root / source, root / target, key) for key in K.TABLE_KEYS}
    for key in src:
        if key.startswith("sparse_optimizer.") and key != column_state:  # v / c kept: v times c_new / c_old
            table = key.removeprefix("sparse_optimizer.").removesuffix(".momentum")
            assert torch.equal(dst[key], src[key] * ratio[table]), f"{name}: {key} is not v / c as saved"
        elif key != column_state:  # tables, dense weights, Adam state
            assert torch.equal(dst[key], src[key]), f"{name}: {key} changed"
    full_src, full_dst = consolidate(root / source), consolidate(root / target)
    assert sorted(full_dst) == sorted(full_src) and all(torch.equal(full_dst[k], full_src[k]) for k in full_src)

    # column-wise AdaGrad state: exact where the target's column blocks lie inside the source's,
    # the column-weighted mean where a target block spans several source blocks
    dim = src[column_state].shape[1]
    blocks = reports[0]["column_blocks"]
    assert (len(blocks) > 1) if size > 1 else (blocks == [(0, dim)]), blocks
    scaled = src[column_state] * ratio[K.COLUMN_WISE]
    expected = K.column_state_after_load(src[column_state], blocks) * ratio[K.COLUMN_WISE]
    assert torch.equal(dst[column_state], expected)
    if exact:
        assert torch.equal(dst[column_state], scaled)
    else:  # the source's two blocks had different accumulators: one mean per row now
        assert not torch.equal(dst[column_state], scaled)
        assert torch.equal(dst[column_state], dst[column_state][:, :1].expand(-1, dim))
        both = (scaled[:, 0] + scaled[:, -1]) / 2
        assert torch.allclose(dst[column_state][:, 0], both, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(RESHARDS))
def test_save_and_load_emit_no_warning(name, request):
    """No warning in a save or a load, in particular none of torch's deprecation of ``ShardedTensor``
    (format 1 was written through it; loading it needs none of it)."""
    run = RESHARDS[name][0]
    for rank, result in enumerate(request.getfixturevalue(run)):
        assert result["reshard"][name]["warnings"] == [], f"rank {rank}"


def test_format1_checkpoint_is_the_one_of_the_sharded_tensor_writer(root, format1, mesh_2x2):
    """The test data is what it claims: format 1, with the tables in chunks of a 2x2 mesh."""
    assert json.loads((format1 / "layout.json").read_text())["format"] == "lightning-twod-checkpoint/1"
    metadata = SafeFileSystemReader(format1).read_metadata().state_dict_metadata
    assert [len(metadata[f"state_dict.{key}"].chunks) for key in K.TABLE_KEYS] == [2, 2, 1]
    assert sorted(metadata) == sorted(SafeFileSystemReader(root / "e1").read_metadata().state_dict_metadata)


def test_reshard_round_trip_2x2_1x4_2x2_is_the_original(root, mesh_2x2):
    original, back = K.read_checkpoint(root / "e1"), K.read_checkpoint(root / "e1_1x4_2x2")
    assert sorted(back) == sorted(original)
    for key in original:
        assert torch.equal(back[key], original[key]), key


def test_data_parallel_table_reshards(root, mesh_2x2):
    plans = [r["reshard"]["data-parallel 2x2 -> 1x4"]["plan"] for r in mesh_2x2]
    assert all(" t_cat " in plan and "data_parallel" in plan for plan in plans)
    original, resaved = K.read_checkpoint(root / "dp"), K.read_checkpoint(root / "dp_1x4")
    assert sorted(resaved) == sorted(original)
    assert original["sparse_optimizer.net.sparse.embedding_bags.t_cat.weight.momentum"].shape == (24,)
    assert original["sparse_optimizer.net.sparse.embedding_bags.t_cat.weight.momentum"].abs().sum() > 0
    # the data-parallel table's accumulator is divided by W = 4 on both meshes, the others' by M: 2, then 1
    scales = [json.loads((root / path / "layout.json").read_text())["accumulator_scales"] for path in ("dp", "dp_1x4")]
    assert [s[K.TABLE_KEYS[2]] for s in scales] == [4, 4] and [s[K.TABLE_KEYS[1]] for s in scales] == [2, 1]
    for key in original:
        table = key.removeprefix("sparse_optimizer.").removesuffix(".momentum")
        ratio = accumulator_ratio(root / "dp", root / "dp_1x4", table) if key.startswith("sparse_optimizer.") else 1.0
        assert torch.equal(resaved[key], original[key] * ratio if ratio != 1.0 else original[key]), key


# ----------------------------------------------------------------------------- 3. export
def test_consolidate_loads_strictly_into_the_unsharded_module(root, mesh_2x2):
    state = consolidate(root / "e1")
    module = K.make_lit(1)
    module.load_state_dict(state, strict=True)
    trained = mesh_2x2[0]["epoch1"]["model"]
    loaded = module.state_dict()
    assert sorted(loaded) == sorted(trained)
    for key, value in trained.items():
        assert torch.equal(loaded[key], torch.as_tensor(value)), key
    initial = K.make_lit(1).state_dict()
    assert all(not torch.equal(initial[key], loaded[key]) for key in K.TABLE_KEYS)
    # the user's own nn.Module takes it as well, under its own keys
    C.make_net().load_state_dict({k.removeprefix("net."): v for k, v in state.items()}, strict=True)


def test_consolidate_refuses_an_incomplete_checkpoint(root, mesh_2x2, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(root / "e1", copy)
    assert sorted(consolidate(copy)) == sorted(consolidate(root / "e1"))
    (copy / COMPLETE).unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"is incomplete \(no COMPLETE marker\).*earlier checkpoint"):
        consolidate(copy)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        consolidate(tmp_path / "missing")


# ----------------------------------------------------------------------------- 4. atomicity
def test_a_save_interrupted_by_a_dead_rank_leaves_the_earlier_checkpoint(root, broken_save):
    assert sorted(broken_save) == [0, 2, 3]  # rank 1 died (run_ranks checked its exit code)
    for rank, result in broken_save.items():
        assert result["saves"] == 2, f"rank {rank}"
        assert result["error"] is not None, f"rank {rank} finished the interrupted save without an error"
        name, message, seconds = result["error"]
        print(f"rank {rank}: {name} after {seconds:.1f}s: {message[:200]}")
    path = root / "atomic"
    # the earlier checkpoint is where it was, complete and byte for byte what the first save wrote
    assert (path / COMPLETE).exists()
    assert dir_digest(path) == broken_save[0]["digest"]
    assert_equal_arrays({k: v.numpy() for k, v in consolidate(path).items()}, broken_save[0]["after_first"],
                        "the earlier checkpoint")
    # the interrupted save left its partial directory: no COMPLETE marker, refused with a clear error
    partials = sorted(root.glob(".twod-partial-*"))
    assert len(partials) == 1
    assert not (partials[0] / COMPLETE).exists()
    assert (partials[0] / f"__{DOOMED_SAVER}_0.distcp").exists()  # the dead rank had written its data
    with pytest.raises(IncompleteCheckpointError, match="is incomplete"):
        consolidate(partials[0])


# ----------------------------------------------------------------------------- 5. faults
def test_a_dead_rank_stops_the_others_within_the_timeout(root, dead_rank):
    assert sorted(dead_rank) == [0, 1, 3]
    for rank, result in dead_rank.items():
        assert result["timeouts"]["world"] == FAULT_TIMEOUT  # Lightning made the group, with the strategy's timeout
        assert result["error"] is not None, f"rank {rank} trained on without rank {DOOMED_TRAINER}"
        name, message, seconds = result["error"]
        print(f"rank {rank}: {name} after {seconds:.1f}s: {message[:200]}")
    saved = sorted(p.name for p in (root / "fault").iterdir())
    assert saved == ["epoch=0-step=4.ckpt"]  # ModelCheckpoint saved epoch 1; epoch 2 never ended
    assert (root / "fault" / saved[0] / COMPLETE).exists()


def test_a_hung_rank_stops_the_others_after_the_timeout(hung_rank):
    assert sorted(hung_rank) == [0, 1, 3]
    timed_out = 0
    for rank, result in hung_rank.items():
        assert result["error"] is not None, f"rank {rank} trained on without rank {DOOMED_TRAINER}"
        name, message, seconds = result["error"]
        print(f"rank {rank}: {name} after {seconds:.1f}s: {message[:200]}")
        # the hung rank and every survivor stay up until all survivors have given up, but a
        # survivor's gloo drops its connections when its own wait times out: one waiting on that
        # survivor, not on the hung rank, can see them closed before its own timeout fires
        timed_out += "timed out" in message.lower()
        assert "timed out" in message.lower() or "closed by peer" in message.lower(), f"rank {rank}: {message}"
    assert timed_out, "no survivor gave up on its own timeout"


def test_mesh_groups_use_the_strategy_timeout(dead_rank):
    for result in dead_rank.values():
        assert result["timeouts"] == {"world": FAULT_TIMEOUT, "shard": FAULT_TIMEOUT, "replica": FAULT_TIMEOUT}


def test_resume_after_a_dead_rank_equals_the_uninterrupted_run(after_faults, mesh_2x2):
    for rank, (result, reference) in enumerate(zip(after_faults, mesh_2x2, strict=True)):
        assert len(result["resumed_seen"]) == K.STEPS_PER_EPOCH
        assert_same_training_state(result["resumed"], reference["uninterrupted"], f"rank {rank}")


def test_after_a_broken_save_the_earlier_checkpoint_loads_and_the_partial_is_refused(after_faults, broken_save):
    for rank, result in enumerate(after_faults):
        earlier = result["earlier"]
        assert earlier["global_step"] == K.STEPS_PER_EPOCH and earlier["seen"] == 0
        assert_equal_arrays(earlier["model"], broken_save[0]["after_first"], f"rank {rank}: the earlier checkpoint")
        assert result["partial"] is not None, f"rank {rank} loaded the partial checkpoint"
        name, message, trace = result["partial"]
        assert name == "IncompleteCheckpointError", trace
        assert "is incomplete (no COMPLETE marker)" in message
