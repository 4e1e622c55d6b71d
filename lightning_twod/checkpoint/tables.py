"""The sharded tables in a checkpoint: this rank's shards as blocks of full-size tensors, both ways.

Embedding tables are stored as tensors of their full ``[rows, dim]`` shape, one saved chunk per
shard (``format``): the ranks of replica group 0 write their shards (every table once, however
many replicas there are), and a loader on another mesh reads just the rows and columns of its own
shards. Row-wise AdaGrad state is stored per row (``[rows]``), or per column (``[rows, dim]``,
constant over each block) for column-wise tables, whose blocks keep separate accumulators.

The accumulator ``v`` of ``momentum_rowwise_adagrad`` is divided by a scale ``c`` that depends on the
mesh (``sparse.optimizers.layout_momentum_scale``): the step is ``lr * g / (sqrt(v / c) + eps)``.
``v`` is saved as it is, and ``layout.json`` records every table's ``c`` (``accumulator_scales``;
1 for plain row-wise AdaGrad); a load multiplies ``v`` by ``c_here / c_saved``, so that ``v / c``,
and with it every row's step size, is the same on the new mesh (``v`` unchanged where the scales
are equal: the same mesh, or a numeric ``momentum_scale``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_twod.checkpoint.directory import MODEL, MOMENTUM, SPARSE_STATE, saved_sparse_optimizer
from lightning_twod.checkpoint.format import LAYOUT, Blocks
from lightning_twod.core.shards import ShardingType
from lightning_twod.sparse.sharded import ShardedCollection, all_parts


@dataclass
class _Entry:
    """One table of one sharded module: its keys and this rank's shards."""

    key: str
    groups: Any  # the MeshGroups of the part holding the table (its replica group 0 writes it)
    rows: int
    dim: int
    column_wise: bool
    data_parallel: bool
    has_state: bool  # the sparse optimizer keeps a row-wise accumulator (same on every rank)
    scale: float  # c: the step divides the accumulator by it (1 unless momentum_rowwise_adagrad)
    shards: list[tuple[Any, Tensor, Tensor | None]]  # (shard, weight view, state view [rows] or None)


def _entries(modules: Mapping[str, ShardedCollection]) -> list[_Entry]:
    entries = []
    for path, module in all_parts(modules):
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
            entries.append(_Entry(key, module.groups, table.num_embeddings, table.embedding_dim, kind == ShardingType.COLUMN_WISE,
                                  kind == ShardingType.DATA_PARALLEL, module.optimizer.has_state,
                                  config.accumulator_scale, shards))
    return entries


def _writers(entry: _Entry) -> bool:
    """Whether this rank writes its copy: replica group 0 of the table's part (data-parallel: rank 0)."""
    return dist.get_rank() == 0 if entry.data_parallel else entry.groups.replica_rank == 0


def sparse_save_state(modules: Mapping[str, ShardedCollection]) -> tuple[dict, dict]:
    """``(weights, optimizer state)`` of every table as :class:`Blocks`; no collective.

    The writers (``_writers``) hold their shards as blocks, every other rank none.
    """
    weights, states = {}, {}
    for entry in _entries(modules):
        mine = entry.shards if _writers(entry) else []
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


def accumulator_scales(modules: Mapping[str, ShardedCollection]) -> dict[str, float]:
    """``{table key: c}`` of every table with a row-wise accumulator (``layout.json``'s ``accumulator_scales``)."""
    return {entry.key: entry.scale for entry in _entries(modules) if entry.has_state}


def _saved_scales(path: Path) -> dict[str, float] | float | None:
    """``accumulator_scales`` of the checkpoint at ``path``; where an earlier version wrote it (no such
    entry), 1.0 for every table if its recorded ``sparse_optimizer`` was plain row-wise AdaGrad (which
    divides by nothing), else None (unknown)."""
    layout = json.loads((path / LAYOUT).read_text())
    scales = layout.get("accumulator_scales")
    if scales is None:
        return 1.0 if saved_sparse_optimizer(layout).get("name") == "rowwise_adagrad" else None
    if not isinstance(scales, dict) or not all(
            isinstance(c, int | float) and not isinstance(c, bool) and 0 < c < float("inf") for c in scales.values()):
        raise ValueError(f"{path / LAYOUT}: 'accumulator_scales' must map table keys to numbers > 0, got {scales!r}")
    return {key: float(c) for key, c in scales.items()}


def sparse_load_request(modules: Mapping[str, ShardedCollection], saved: Mapping[str, Any],
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


class _TablesLeftOut:
    """While active, ``state_dict()`` of the sharded modules leaves the tables out."""

    def __init__(self, modules: Mapping[str, ShardedCollection]) -> None:
        self.modules = list(modules.values())

    def __enter__(self):
        for module in self.modules:
            module.state_dict_tables = False

    def __exit__(self, *exc):
        for module in self.modules:
            module.state_dict_tables = True


def dense_state_dict(model: torch.nn.Module, modules: Mapping[str, ShardedCollection]) -> dict[str, Tensor]:
    """The model's state dict without the sharded tables (no collective)."""
    with _TablesLeftOut(modules):
        return model.state_dict()
