"""The temporary directories of a save (``checkpoint.directory``) beside Lightning's hpc checkpoints:
Lightning numbers ``hpc_ckpt_<N>.ckpt`` from the digits of every name in the folder that contains
``hpc_ckpt_``, so a leftover partial directory (a save killed by SLURM) must not count."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_twod.checkpoint.directory import (
    COMPLETE,
    IncompleteCheckpointError,
    check_complete,
    finish,
    partial_path,
)

TAG = "1765070000123456789-4242"  # time_ns()-pid, as save_distributed makes it


def _save(path, tag: str = TAG):
    """A save of ``path`` up to the rename: its partial directory with a data file."""
    partial = partial_path(path, tag)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"data")
    return partial


def test_a_leftover_partial_leaves_lightnings_hpc_numbering_alone(tmp_path):
    finish(tmp_path / "hpc_ckpt_1.ckpt", _save(tmp_path / "hpc_ckpt_1.ckpt", "1-1"))
    leftover = _save(tmp_path / "hpc_ckpt_2.ckpt")  # killed before it finished
    assert (tmp_path / "hpc_ckpt_1.ckpt" / COMPLETE).exists() and not (leftover / COMPLETE).exists()
    # the next requeue saves hpc_ckpt_2, and a resume (ckpt_path=None under SLURM, or "hpc") reads hpc_ckpt_1
    assert _CheckpointConnector.hpc_save_path(tmp_path) == os.path.join(tmp_path, "hpc_ckpt_2.ckpt")
    latest = _CheckpointConnector._CheckpointConnector__get_max_ckpt_path_from_folder(tmp_path)
    assert latest == f"{tmp_path}/hpc_ckpt_1.ckpt"
    with pytest.raises(IncompleteCheckpointError, match="is incomplete"):  # the leftover is still refused
        check_complete(leftover)


def test_a_finished_save_replaces_the_older_checkpoint_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "hpc_ckpt_3.ckpt"
    finish(path, _save(path, "1-1"))
    finish(path, _save(path, "2-1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_3.ckpt"]
    assert sorted(p.name for p in path.iterdir()) == [COMPLETE, "__0_0.distcp"]
