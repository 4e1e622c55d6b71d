"""A checkpoint's full, unsharded model on one process without a process group.

* ``consolidate``: its state dict (keys and shapes of the unsharded LightningModule);
* ``lightning_checkpoint``: a single-file Lightning checkpoint of it (that state dict, the
  hyper-parameters, loops and callbacks; no optimizer state), which any Trainer reads;
* ``load_from_checkpoint``: ``Model.load_from_checkpoint`` for a checkpoint directory too.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.saving import _load_state
from torch import Tensor

from lightning_twod.checkpoint.directory import MODEL, check_complete, read_trainer_state
from lightning_twod.checkpoint.format import SafeFileSystemReader


def consolidate(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's full state dict from a checkpoint directory, on one process.

    Keys and shapes match the user's unsharded LightningModule (a table: ``[rows, dim]``), so the
    result loads with ``model.load_state_dict(state, strict=True)``. Needs no process group.
    """
    if Path(path).is_file():  # a single-file Lightning checkpoint already holds full tables
        return dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
    path = check_complete(path)
    reader = SafeFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    prefix = MODEL + "."
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for k, md in saved.items() if k.startswith(prefix) and hasattr(md, "size")}
    with warnings.catch_warnings():  # DCP warns that no process group exists: none is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


def lightning_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint directory at ``path`` as the dict of a single-file Lightning checkpoint: its
    ``trainer_state.pt`` (hyper-parameters, loops, callbacks) with ``state_dict`` the full model
    (``consolidate``) and no optimizer state. ``torch.save`` it for any Trainer's ``ckpt_path``
    (``validate``, ``test``, ``predict``; ``fit`` starts its optimizers afresh) or
    ``Model.load_from_checkpoint``. A single-file ``path`` is read as it is."""
    if Path(path).is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    state = consolidate(path)  # checks that the directory is complete and readable first
    checkpoint = read_trainer_state(Path(path))
    checkpoint.pop("twod_optimizers", None)
    return {**checkpoint, "state_dict": state, "optimizer_states": []}


def load_from_checkpoint(cls: Any, path: str | os.PathLike, map_location: str | torch.device | None = None,
                         strict: bool | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, **kwargs)`` that also reads a checkpoint directory, on one process.

    ``cls``: a LightningModule class. Its constructor gets the hyper-parameters saved with the
    checkpoint (those of ``save_hyperparameters()``) updated by ``kwargs``, and the model gets the
    full tables (``consolidate``) with Lightning's ``strict`` rule and ``on_load_checkpoint`` hook, as
    Lightning's ``load_from_checkpoint`` does; ``map_location`` (a device) moves the model there. The
    state dict is handed to the model as it is read (no copy), so the process needs memory for about
    twice the model. A single-file ``path`` goes to ``cls.load_from_checkpoint`` (safe loading). E.g.
    ``model = load_from_checkpoint(DLRM, "checkpoints/movielens_2x2/last.ckpt")``.
    """
    if Path(path).is_file():
        return cls.load_from_checkpoint(path, map_location=map_location, strict=strict,
                                        **{"weights_only": True, **kwargs})
    checkpoint = lightning_checkpoint(path)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)  # builds cls, then load_state_dict
    return model if map_location is None else model.to(torch.device(map_location))
