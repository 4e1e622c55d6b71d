"""Save and load a distributed checkpoint of a sharded model: the strategies' entry points, collectives.

Every rank writes its part without gathering (the tables as blocks: ``tables``; dense tensors and the
dense optimizers' tensors as DCP data: ``optimizer``) into a partial directory that rank 0 then
completes (``directory``); a load on any mesh reads each rank's own rows and columns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_twod.checkpoint.directory import (
    MODEL,
    SPARSE_STATE,
    TRAINER_STATE,
    check_complete,
    finish,
    partial_path,
    read_layout,
    read_trainer_state,
    to_plain,
    write_layout,
)
from lightning_twod.checkpoint.format import BlockLoadPlanner, BlockSavePlanner, SafeFileSystemReader
from lightning_twod.checkpoint.optimizer import load_request, load_state, optimizer_tensors, state_to_save
from lightning_twod.checkpoint.tables import (
    accumulator_scales,
    dense_state_dict,
    sparse_load_request,
    sparse_save_state,
    table_optimizers,
)
from lightning_twod.sparse.sharded import ShardedCollection


def save_distributed(path: str | os.PathLike, checkpoint: dict, model: torch.nn.Module, optimizers: list,
                     modules: Mapping[str, ShardedCollection], layout: dict) -> Path:
    """Write ``checkpoint`` (Lightning's dict) as a distributed checkpoint; a collective.

    The dense ``state_dict`` and ``optimizer_states`` in ``checkpoint`` are replaced by what this
    function gathers itself: dense tensors, sharded tables and their states, optimizer tensors.
    """
    path = Path(path)
    tag = [f"{time.time_ns()}-{os.getpid()}"]
    dist.broadcast_object_list(tag, src=0)
    partial = partial_path(path, tag[0])
    checkpoint = dict(checkpoint)
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    flat: dict[str, Any] = {f"{MODEL}.{k}": v for k, v in dense_state_dict(model, modules).items()}
    weights, states = sparse_save_state(modules)
    layout = {**layout, "accumulator_scales": accumulator_scales(modules), "table_optimizers": table_optimizers(modules)}
    blocks = {f"{MODEL}.{k}": v for k, v in weights.items()}
    blocks.update({f"{SPARSE_STATE}.{k}": v for k, v in states.items()})
    optimizer_meta = []
    for index, optimizer in enumerate(optimizers):
        tensors, rest = optimizer_tensors(index, state_to_save(model, optimizer))
        flat.update(tensors)
        optimizer_meta.append(rest)
    checkpoint["optimizer_states"] = []  # restored from the DCP data by load_distributed
    checkpoint["twod_optimizers"] = optimizer_meta
    dcp.save(flat, checkpoint_id=partial, planner=BlockSavePlanner(blocks))
    if dist.get_rank() == 0:
        torch.save(to_plain(checkpoint), partial / TRAINER_STATE)
        write_layout(partial, layout)
    dist.barrier()
    if dist.get_rank() == 0:
        finish(path, partial)
    dist.barrier()
    return path


def load_distributed(path: str | os.PathLike, model: torch.nn.Module, optimizers: list,
                     modules: Mapping[str, ShardedCollection], groups) -> dict:
    """Load a distributed checkpoint saved on any mesh into this rank's shards, dense weights and
    optimizers, in place; returns the rest of Lightning's checkpoint dict. A collective.

    Every rank reads its own shards' rows and columns, so ``groups`` (the mesh) is not consulted;
    any format of ``format.READABLE_FORMATS`` loads.
    """
    path = check_complete(path)
    trainer_state = read_trainer_state(path)
    reader = SafeFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    request: dict[str, Any] = {f"{MODEL}.{k}": v for k, v in dense_state_dict(model, modules).items()}
    blocks, finalize = sparse_load_request(modules, saved, path)
    templates = []
    for index, optimizer in enumerate(optimizers):
        tensors = load_request(index, model, optimizer, saved)
        missing = sorted(set(tensors) - set(saved))
        if missing:
            raise KeyError(f"checkpoint {path} has no state for optimizer {index} entries {missing[:5]}; "
                           "was it saved with the same configure_optimizers?")
        request.update(tensors)
        templates.append(tensors)
    dcp.load(request, storage_reader=reader, planner=BlockLoadPlanner(blocks, path))
    finalize()
    meta = trainer_state.get("twod_optimizers", [])
    for index, (optimizer, tensors) in enumerate(zip(optimizers, templates, strict=True)):
        state = {"param_groups": meta[index]["param_groups"], "state": {}}
        for fqn, values in meta[index]["state"].items():
            state["state"].setdefault(fqn, {}).update(values)
        prefix = f"optimizer_{index}."
        for key in tensors:
            fqn, _, name = key[len(prefix):].rpartition(".")
            state["state"].setdefault(fqn, {})[name] = request[key]
        load_state(model, optimizer, state, path)
    return trainer_state


def _mesh(layout: Mapping[str, Any]) -> str:
    """``"2x3 (contiguous)"``: replica groups x ranks per shard group, and the placement."""
    world, size = layout.get("world_size"), layout.get("shard_group_size")
    mesh = f"{world // size}x{size}" if isinstance(world, int) and isinstance(size, int) and size else "an unknown mesh"
    return f"{mesh} ({layout.get('placement', 'unknown placement')})"


def resharding(path: str | os.PathLike, layout: Mapping[str, Any]) -> str:
    """How the checkpoint at ``path`` was saved, where this run's ``layout`` (``save_distributed``'s
    argument: mesh and sharding plans) differs from it, e.g. ``"saved on 2x3 (contiguous), loading on
    2x2 (contiguous)"``; ``""`` where the two agree."""
    saved = read_layout(Path(path))
    if _mesh(saved) != _mesh(layout):
        return f"saved on {_mesh(saved)}, loading on {_mesh(layout)}"
    if saved.get("plans") != layout.get("plans"):
        return f"saved on {_mesh(saved)} too, with another sharding plan"
    return ""
