"""Distributed checkpoints of sharded models: save without gathering, load on any mesh, export.

A checkpoint is a directory::

    ckpt/
      .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP) data: tensors only
      trainer_state.pt               loops, callbacks, hyper-parameters, optimizer param groups
                                     (no tensors of the model; read with torch.load(weights_only=True))
      layout.json                    format version (checked on load), mesh and sharding plan that wrote it,
                                     the accumulators' scales (read on load)
      COMPLETE                       written last, after every rank finished

Embedding tables are stored as tensors of their full ``[rows, dim]`` shape, one saved chunk per
shard (``checkpoint_format``): the ranks of replica group 0 write their shards (every table once,
however many replicas there are), and a loader on another mesh reads just the rows and columns of
its own shards. Row-wise AdaGrad state is stored per row (``[rows]``), or per column (``[rows,
dim]``, constant over each block) for column-wise tables, whose blocks keep separate accumulators.

The accumulator ``v`` of ``momentum_rowwise_adagrad`` is divided by a scale ``c`` that depends on the
mesh (``sparse.optimizers.layout_momentum_scale``): the step is ``lr * g / (sqrt(v / c) + eps)``.
``v`` is saved as it is, and ``layout.json`` records every table's ``c`` (``accumulator_scales``;
1 for plain row-wise AdaGrad); a load multiplies ``v`` by ``c_here / c_saved``, so that ``v / c``,
and with it every row's step size, is the same on the new mesh (``v`` unchanged where the scales
are equal: the same mesh, or a numeric ``momentum_scale``).

Writing goes to ``<path>.partial-<id>``; after a barrier, rank 0 writes ``COMPLETE`` and renames
it to ``<path>`` (an older checkpoint at ``<path>`` is replaced only then). A save interrupted by
a dead rank leaves the partial directory without ``COMPLETE``; loading refuses it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_twod.checkpoint.format import (
    FORMAT,
    LAYOUT,
    BlockLoadPlanner,
    Blocks,
    BlockSavePlanner,
    SafeFileSystemReader,
    check_format,
)
from lightning_twod.sparse.sharded import _ShardedCollection
from lightning_twod.core.shards import ShardingType

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
MODEL = "state_dict"
SPARSE_STATE = "sparse_optimizer"
MOMENTUM = ".momentum"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory whose save did not finish."""


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Any directory: Lightning's own checkpoints are single files, and a save interrupted before DCP
    wrote ``.metadata`` leaves a directory with data files only (``check_complete`` refuses it)."""
    return Path(path).is_dir()


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


# --------------------------------------------------------------------------- tables as blocks
@dataclass
class _Entry:
    """One table of one sharded module: its keys and this rank's shards."""

    key: str
    rows: int
    dim: int
    column_wise: bool
    data_parallel: bool
    has_state: bool  # the sparse optimizer keeps a row-wise accumulator (same on every rank)
    scale: float  # c: the step divides the accumulator by it (1 unless momentum_rowwise_adagrad)
    shards: list[tuple[Any, Tensor, Tensor | None]]  # (shard, weight view, state view [rows] or None)


def _entries(modules: Mapping[str, _ShardedCollection]) -> list[_Entry]:
    entries = []
    for path, module in modules.items():
        for table in module.tables:
            kind = module.plan[table.name].sharding_type
            config = module.data_parallel_optimizer if kind == ShardingType.DATA_PARALLEL else module.optimizer
            shards = []
            for kernel, kernel_shards in module.kernel_shards():
                states = kernel.optimizer_states()
                for k, shard in enumerate(kernel_shards):
                    if shard.table == table.name:
                        shards.append((shard, kernel.weights()[k], states[k] if states else None))
            key = f"{path}.{module.state_key(table.name)}" if path else module.state_key(table.name)
            entries.append(_Entry(key, table.num_embeddings, table.embedding_dim, kind == ShardingType.COLUMN_WISE,
                                  kind == ShardingType.DATA_PARALLEL, module.optimizer.has_state,
                                  config.accumulator_scale, shards))
    return entries


def _writers(module_groups, entry: _Entry) -> bool:
    """Whether this rank writes its copy: replica group 0 (data-parallel: rank 0)."""
    return dist.get_rank() == 0 if entry.data_parallel else module_groups.replica_rank == 0


def sparse_save_state(modules: Mapping[str, _ShardedCollection], groups) -> tuple[dict, dict]:
    """``(weights, optimizer state)`` of every table as :class:`Blocks`; no collective.

    The writers (``_writers``) hold their shards as blocks, every other rank none.
    """
    weights, states = {}, {}
    for entry in _entries(modules):
        mine = entry.shards if _writers(groups, entry) else []
        weights[entry.key] = Blocks(torch.Size([entry.rows, entry.dim]),
                                    [((s.row_start, s.col_start), w) for s, w, _ in mine])
        if not entry.has_state:
            continue
        if entry.column_wise:
            local = [((s.row_start, s.col_start), st.unsqueeze(1).expand(-1, s.dim).contiguous())
                     for s, _, st in mine]
            states[entry.key + MOMENTUM] = Blocks(torch.Size([entry.rows, entry.dim]), local)
        else:
            states[entry.key + MOMENTUM] = Blocks(torch.Size([entry.rows]), [((s.row_start,), st) for s, _, st in mine])
    return weights, states


def accumulator_scales(modules: Mapping[str, _ShardedCollection]) -> dict[str, float]:
    """``{table key: c}`` of every table with a row-wise accumulator (``layout.json``'s ``accumulator_scales``)."""
    return {entry.key: entry.scale for entry in _entries(modules) if entry.has_state}


def _saved_scales(path: Path) -> dict[str, float] | float | None:
    """``accumulator_scales`` of the checkpoint at ``path``; where an earlier version wrote it (no such
    entry), 1.0 for every table if its recorded ``sparse_optimizer`` was plain row-wise AdaGrad (which
    divides by nothing), else None (unknown)."""
    layout = json.loads((path / LAYOUT).read_text())
    scales = layout.get("accumulator_scales")
    if scales is None:
        return 1.0 if "name='rowwise_adagrad'" in str(layout.get("sparse_optimizer", "")) else None
    if not isinstance(scales, dict) or not all(
            isinstance(c, int | float) and not isinstance(c, bool) and 0 < c < float("inf") for c in scales.values()):
        raise ValueError(f"{path / LAYOUT}: 'accumulator_scales' must map table keys to numbers > 0, got {scales!r}")
    return {key: float(c) for key, c in scales.items()}


def sparse_load_request(modules: Mapping[str, _ShardedCollection], saved: Mapping[str, Any],
                        path: Path) -> tuple[dict[str, Blocks], Any]:
    """The blocks to read for this rank's shards (any saving mesh), and a function to call after reading.

    ``saved`` is the checkpoint's ``state_dict_metadata``. Weights load in place; row-wise states
    go through buffers that the returned function folds into the kernels' accumulators, times
    ``c_here / c_saved`` (``accumulator_scales``) where the two scales differ.
    """
    request: dict[str, Blocks] = {}
    fixups = []
    scales, unknown = _saved_scales(path), []
    for entry in _entries(modules):
        weight_key = f"{MODEL}.{entry.key}"
        if weight_key not in saved:
            tables = sorted(k[len(MODEL) + 1:] for k in saved if k.startswith(MODEL + "."))
            raise KeyError(f"checkpoint {path} has no table {entry.key}; it holds {tables}")
        if list(saved[weight_key].size) != [entry.rows, entry.dim]:
            raise ValueError(f"table {entry.key} is {[entry.rows, entry.dim]} here but "
                             f"{list(saved[weight_key].size)} in checkpoint {path}")
        request[weight_key] = Blocks(torch.Size([entry.rows, entry.dim]),
                                     [((s.row_start, s.col_start), w) for s, w, _ in entry.shards])
        if not entry.has_state:
            continue
        state_key = f"{SPARSE_STATE}.{entry.key}{MOMENTUM}"
        if state_key not in saved:
            raise KeyError(f"checkpoint {path} has no row-wise optimizer state for {entry.key} "
                           "(it was saved with a stateless sparse optimizer such as sgd)")
        per_column = len(saved[state_key].size) == 2
        if isinstance(scales, float):  # every table's
            ratio = entry.scale / scales
        elif scales is None or entry.key not in scales:
            ratio = 1.0  # the scale it was saved with is unknown: as saved
            unknown += [entry.key] if entry.scale != 1.0 else []
        else:
            ratio = entry.scale / scales[entry.key]
        buffers = []
        for shard, _, state in entry.shards:
            shape, offsets = ((shard.rows, shard.dim), (shard.row_start, shard.col_start)) if per_column \
                else ((shard.rows,), (shard.row_start,))
            buffers.append((offsets, torch.zeros(shape, device=state.device)))
            fixups.append((state, buffers[-1][1], ratio))
        size = [entry.rows, entry.dim] if per_column else [entry.rows]
        request[state_key] = Blocks(torch.Size(size), buffers)
    if unknown and dist.get_rank() == 0:
        warnings.warn(f"checkpoint {path} does not say by what its row-wise AdaGrad accumulators were divided "
                      f"(no 'accumulator_scales' in {LAYOUT}: an earlier version wrote it); those of {unknown} "
                      "load as saved, which keeps their step sizes only if it was written on this mesh (or with "
                      "the same numeric momentum_scale)", stacklevel=2)

    @torch.no_grad()
    def finalize() -> None:
        for state, buffer, ratio in fixups:
            if buffer.dim() == 1:
                state.copy_(buffer)
            else:
                # A per-column state is constant over each saved block, so the mean over this shard's
                # columns is the column-weighted accumulator; where the shard lies inside one saved
                # block the columns are equal and the first one is taken as it is (bit-exact resume).
                constant = (buffer == buffer[:, :1]).all(dim=1)
                state.copy_(torch.where(constant, buffer[:, 0], buffer.mean(dim=1)))
            if ratio != 1.0:  # v / c as saved: the same step size on this mesh
                state.mul_(ratio)

    return request, finalize


# --------------------------------------------------------------------------- atomic directory
def partial_path(path: Path, tag: str) -> Path:
    return path.with_name(f"{path.name}.partial-{tag}")


def finish(path: Path, partial: Path) -> None:
    """Rank 0, after every rank wrote: mark complete, then swap the directory into place."""
    (partial / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}.old-{os.getpid()}")
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


def read_trainer_state(path: Path) -> dict:
    try:
        return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"{path / TRAINER_STATE} holds objects that safe loading refuses ({err}); keep hyper-parameters "
            "and callback states to numbers, strings, lists and dicts"
        ) from err


# --------------------------------------------------------------------------- export
def consolidate(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's full state dict from a checkpoint directory, on one process.

    Keys and shapes match the user's unsharded LightningModule, so the result loads with
    ``model.load_state_dict(state, strict=True)``. Needs no process group.
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


# --------------------------------------------------------------------------- single-file checkpoints
def dense_optimizer_state(state: dict, optimizer: torch.optim.Optimizer, unsharded: list[tuple[str, bool]],
                          model: torch.nn.Module) -> tuple[dict | None, str]:
    """An optimizer state saved for the unsharded model (tables included), for ``optimizer`` whose
    groups hold only the dense parameters: ``(state, "")``, or ``(None, why)`` when it cannot map.

    ``unsharded``: ``(parameter name, is a table)`` of the unsharded model in its order. Each saved
    group must be the current group plus table parameters, all in the model's order (what an
    optimizer built from ``model.parameters()`` or from filtered lists of it has); every restored
    tensor must have its parameter's shape.
    """
    saved_groups, groups = state.get("param_groups", []), optimizer.param_groups
    if len(saved_groups) != len(groups):
        return None, f"{len(saved_groups)} parameter group(s) in the checkpoint, {len(groups)} here"
    position = {name: i for i, (name, _) in enumerate(unsharded)}
    tables = [name for name, table in unsharded if table]
    names = {id(p): n for n, p in model.named_parameters()}
    template = optimizer.state_dict()
    mapped: dict = {"state": {}, "param_groups": []}
    for saved, group, indices in zip(saved_groups, groups, (g["params"] for g in template["param_groups"]),
                                     strict=True):
        dense = [names.get(id(p)) for p in group["params"]]
        if any(n not in position for n in dense) or dense != sorted(dense, key=position.__getitem__):
            return None, "its parameters are not the model's, in the model's order"
        extra = len(saved["params"]) - len(dense)
        if extra == 0:
            order = dense
        elif extra == len(tables):
            order = sorted(dense + tables, key=position.__getitem__)
        else:
            return None, (f"a group held {len(saved['params'])} parameters, here {len(dense)} dense and "
                          f"{len(tables)} tables")
        new_index = dict(zip(dense, indices, strict=True))
        params = dict(zip(group["params"], dense, strict=True))
        shapes = {name: p.shape for p, name in params.items()}
        for name, saved_index in zip(order, saved["params"], strict=True):
            if name not in new_index or saved_index not in state.get("state", {}):
                continue
            values = state["state"][saved_index]
            wrong = [k for k, v in values.items() if isinstance(v, Tensor) and v.dim() and v.shape != shapes[name]]
            if wrong:
                return None, f"its {wrong} for {name!r} has another shape than the parameter"
            mapped["state"][new_index[name]] = values
        mapped["param_groups"].append({**saved, "params": list(indices)})
    return mapped, ""


# --------------------------------------------------------------------------- strategy entry points
class _TablesLeftOut:
    """While active, ``state_dict()`` of the sharded modules leaves the tables out."""

    def __init__(self, modules: Mapping[str, _ShardedCollection]) -> None:
        self.modules = list(modules.values())

    def __enter__(self):
        for module in self.modules:
            module.state_dict_tables = False

    def __exit__(self, *exc):
        for module in self.modules:
            module.state_dict_tables = True


def dense_state_dict(model: torch.nn.Module, modules: Mapping[str, _ShardedCollection]) -> dict[str, Tensor]:
    """The model's state dict without the sharded tables (no collective)."""
    with _TablesLeftOut(modules):
        return model.state_dict()


def _optimizer_tensors(index: int, state: dict) -> tuple[dict[str, Tensor], dict]:
    """Split an FQN-keyed optimizer state dict into its tensors (flat keys) and the rest."""
    tensors, rest = {}, {"param_groups": state.get("param_groups", []), "state": {}}
    for fqn, values in state.get("state", {}).items():
        for name, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer_{index}.{fqn}.{name}"] = value
            else:
                rest["state"].setdefault(fqn, {})[name] = value
    return tensors, rest


def save_distributed(path: str | os.PathLike, checkpoint: dict, model: torch.nn.Module, optimizers: list,
                     modules: Mapping[str, _ShardedCollection], groups, layout: dict) -> Path:
    """Write ``checkpoint`` (Lightning's dict) as a distributed checkpoint; a collective.

    The dense ``state_dict`` and ``optimizer_states`` in ``checkpoint`` are replaced by what this
    function gathers itself: dense tensors, sharded tables and their states, optimizer tensors.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path = Path(path)
    tag = [f"{time.time_ns()}-{os.getpid()}"]
    dist.broadcast_object_list(tag, src=0)
    partial = partial_path(path, tag[0])
    checkpoint = dict(checkpoint)
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    flat: dict[str, Any] = {f"{MODEL}.{k}": v for k, v in dense_state_dict(model, modules).items()}
    weights, states = sparse_save_state(modules, groups)
    layout = {**layout, "accumulator_scales": accumulator_scales(modules)}
    blocks = {f"{MODEL}.{k}": v for k, v in weights.items()}
    blocks.update({f"{SPARSE_STATE}.{k}": v for k, v in states.items()})
    optimizer_meta = []
    for index, optimizer in enumerate(optimizers):
        tensors, rest = _optimizer_tensors(index, get_optimizer_state_dict(model, optimizer))
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
                     modules: Mapping[str, _ShardedCollection], groups) -> dict:
    """Load a distributed checkpoint saved on any mesh into this rank's shards, dense weights and
    optimizers, in place; returns the rest of Lightning's checkpoint dict. A collective.

    Every rank reads its own shards' rows and columns, so ``groups`` (the mesh) is not consulted;
    any format of ``checkpoint_format.READABLE_FORMATS`` loads.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = check_complete(path)
    trainer_state = read_trainer_state(path)
    reader = SafeFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    request: dict[str, Any] = {f"{MODEL}.{k}": v for k, v in dense_state_dict(model, modules).items()}
    blocks, finalize = sparse_load_request(modules, saved, path)
    templates = []
    for index, optimizer in enumerate(optimizers):
        tensors, _ = _optimizer_tensors(index, get_optimizer_state_dict(model, optimizer))
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
        set_optimizer_state_dict(model, optimizer, state)
    return trainer_state
