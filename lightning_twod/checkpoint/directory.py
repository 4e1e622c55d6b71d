"""The checkpoint directory: what it holds, and how it is written so that a reader never sees half of it.

A checkpoint is a directory::

    ckpt/
      .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP) data: tensors only
      trainer_state.pt               loops, callbacks, hyper-parameters, optimizer param groups
                                     (no tensors of the model; read with torch.load(weights_only=True))
      layout.json                    format version (checked on load), mesh, sparse optimizer (its fields)
                                     and sharding plan that wrote it, the accumulators' scales (read on load)
      COMPLETE                       written last, after every rank finished

The DCP data holds the model under ``state_dict.<key>`` (dense tensors, and every table at its full
``[rows, dim]`` size: ``tables``), the tables' sparse optimizer states under
``sparse_optimizer.<table key>.momentum`` (row-wise AdaGrad's accumulator) or one key a state of the Adam
family, ``sparse_optimizer.<table key>.momentum1``, ``.momentum2`` and ``.step``, and the dense
optimizers' tensors under
``optimizer_<index>.<parameter>.<name>`` (``optimizer``).

Writing goes to ``.twod-partial-<id>`` beside ``<path>``; after a barrier, rank 0 writes ``COMPLETE``
and renames it to ``<path>`` (an older checkpoint at ``<path>`` is replaced only then, moved aside
to ``.twod-old-<pid>`` for the time of the rename). A save interrupted by a dead rank leaves the
partial directory without ``COMPLETE``; loading refuses it. The temporary names never hold the
checkpoint's: Lightning numbers ``hpc_ckpt_<N>.ckpt`` from the digits of every name in the folder
that contains ``hpc_ckpt_``, so a leftover ``hpc_ckpt_2.ckpt.partial-<ns>-<pid>`` would send the
next save and the resume to a number of 20 digits.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_twod.checkpoint.format import FORMAT, LAYOUT, check_format
from lightning_twod.sparse.optimizers import OPTIMIZERS

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
#: Key prefixes of the DCP data: the model's tensors, and the tables' row-wise optimizer states.
MODEL = "state_dict"
SPARSE_STATE = "sparse_optimizer"
#: Suffix of a table's row-wise optimizer state under ``SPARSE_STATE``.
MOMENTUM = ".momentum"


def state_suffix(optimizer: str, name: str) -> str:
    """Suffix of a table's state ``name`` (``SparseOptimizerConfig.state_shapes``) of the sparse optimizer
    ``optimizer`` under ``SPARSE_STATE``: ``MOMENTUM`` for the one accumulator of the row-wise optimizers
    (the key every version wrote), ``.<name>`` for the Adam family's."""
    return MOMENTUM if optimizer in OPTIMIZERS else f".{name}"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory whose save did not finish."""


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Any directory: Lightning's own checkpoints are single files, and a save interrupted before DCP
    wrote ``.metadata`` leaves a directory with data files only (``check_complete`` refuses it)."""
    return Path(path).is_dir()


def strategy_needed(path: str | os.PathLike) -> str:
    """What to do with the checkpoint directory at ``path`` where a strategy that reads single files met it."""
    return (f"{path} is a distributed checkpoint (a directory that TwoDSparseStrategy wrote, each rank its "
            "shards); only the 2D strategies read it. Run with the 2D strategy (trainer.strategy: twod_sparse, "
            f"any mesh), or export it once: `lightning-twod consolidate {path} model.ckpt --lightning` writes a "
            "single-file checkpoint for any Trainer and Model.load_from_checkpoint (in Python, in one call: "
            "lightning_twod.checkpoint.load_from_checkpoint(Model, path))")


def check_complete(path: str | os.PathLike) -> Path:
    """Return ``path`` if it holds a complete checkpoint in a readable format, else raise with what to do."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not (path / COMPLETE).exists():
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete (no {COMPLETE} marker): its save was interrupted, so it is "
            "refused. Resume from an earlier checkpoint."
        )
    check_format(path)
    return path


def partial_path(path: Path, tag: str) -> Path:
    """Where the save of ``path`` writes first: a hidden sibling whose name holds ``tag`` (one for all
    ranks), not the checkpoint's name (see the module's docstring)."""
    return path.with_name(f".twod-partial-{tag}")


def finish(path: Path, partial: Path) -> None:
    """Rank 0, after every rank wrote: mark complete, then swap the directory into place."""
    (partial / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    old = None
    if path.exists():
        old = path.with_name(f".twod-old-{os.getpid()}")
        path.rename(old)
    partial.rename(path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def to_plain(value: Any) -> Any:
    """Dict subclasses (e.g. Lightning's AttributeDict) as plain dicts, for weights-only loading."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


def write_layout(partial: Path, layout: dict) -> None:
    (partial / LAYOUT).write_text(json.dumps({"format": FORMAT, **layout}, indent=2, sort_keys=True))


def read_layout(path: Path) -> dict:
    """``layout.json`` of a checkpoint whose format ``check_complete`` accepted."""
    return json.loads((path / LAYOUT).read_text())


def saved_sparse_optimizer(layout: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of the sparse optimizer that ``layout`` (a ``layout.json``) records, e.g. ``{"name":
    "rowwise_adagrad", "lr": 0.05, "eps": 1e-08, "momentum_scale": 2.0}``; ``{}`` without one. Earlier
    versions wrote the config's ``repr`` (``"SparseOptimizerConfig(name='rowwise_adagrad', lr=0.05, ...)"``)."""
    saved = layout.get("sparse_optimizer")
    if isinstance(saved, Mapping):
        return dict(saved)
    if not isinstance(saved, str):
        return {}
    return {key: ast.literal_eval(value) for key, value in re.findall(r"(\w+)=('[^']*'|[^,)]+)", saved)}


def read_trainer_state(path: Path) -> dict:
    try:
        return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"{path / TRAINER_STATE} holds objects that safe loading refuses ({err}); keep hyper-parameters "
            "and callback states to numbers, strings, lists and dicts"
        ) from err
