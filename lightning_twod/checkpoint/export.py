"""``consolidate``: a checkpoint's full, unsharded state dict, on one process without a process group."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_twod.checkpoint.directory import MODEL, check_complete
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
