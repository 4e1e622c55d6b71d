"""The sharded tables in a checkpoint: this rank's shards as blocks of full-size tensors, both ways.

Embedding tables are stored as tensors of their full ``[rows, dim]`` shape, one saved chunk per
shard (``format``): the ranks of replica group 0 write their shards (every table once, however
many replicas there are), and a loader on another mesh reads just the rows and columns of its own
shards. Row-wise AdaGrad state is stored per row (``[rows]``), or per column (``[rows, dim]``,
constant over each block) for column-wise tables, whose blocks keep separate accumulators; so are the
Adam family's states of one number a row (``step``, ``rowwise_adam``'s ``momentum2``), and its states
of one number an element (``momentum1``, ``momentum2``) at the tables' ``[rows, dim]``.

The accumulator ``v`` of ``momentum_rowwise_adagrad`` is divided by a scale ``c`` that depends on the
mesh (``sparse.optimizers.layout_momentum_scale``): the step is ``lr * g / (sqrt(v / c) + eps)``.
``v`` is saved as it is, and ``layout.json`` records every table's ``c`` (``accumulator_scales``;
1 for plain row-wise AdaGrad); a load multiplies ``v`` by ``c_here / c_saved``, so that ``v / c``,
and with it every row's step size, is the same on the new mesh (``v`` unchanged where the scales
are equal: the same mesh, or a numeric ``momentum_scale``).

The Adam family's states load as saved on any mesh (``c = 1``): its update ``m / sqrt(v)`` is the same
for gradients ``k`` times larger (``m`` grows ``k`` times, ``v`` ``k**2`` times), so no layout factor
enters the step, and ``m``, ``v`` and ``step`` are each the replicas' mean, which is what a copy on any
mesh holds after a reduction (``sparse.optimizers.layout_momentum_scale`` says what that mean is).
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

from lightning_twod.checkpoint.directory import MODEL, SPARSE_STATE, saved_sparse_optimizer, state_suffix
from lightning_twod.checkpoint.format import LAYOUT, Blocks
from lightning_twod.core.shards import ShardingType
from lightning_twod.sparse.optimizers import ADAM_OPTIMIZERS, OPTIMIZERS, SparseOptimizerConfig
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
    optimizer: SparseOptimizerConfig  # the sparse optimizer of the table (the same on every rank)
    shards: list[tuple[Any, Tensor, dict[str, Tensor]]]  # (shard, weight view, its states by name)

    @property
    def scale(self) -> float:
        """``c``: the step divides the row-wise accumulator by it (1 unless momentum_rowwise_adagrad)."""
        return self.optimizer.accumulator_scale

    @property
    def has_accumulator(self) -> bool:
        """Whether the table's state is one row-wise accumulator (its ``c`` is recorded)."""
        return self.optimizer.has_state and self.optimizer.name in OPTIMIZERS

    def state_key(self, name: str) -> str:
        """The key of its state ``name`` under ``SPARSE_STATE`` (``directory.state_suffix``)."""
        return self.key + state_suffix(self.optimizer.name, name)

    def per_row(self, name: str) -> bool:
        """Whether its state ``name`` holds one number a row (``[rows]``), not one an element."""
        return len(self.optimizer.state_shapes(1, 1)[name]) == 1


def _entries(modules: Mapping[str, ShardedCollection]) -> list[_Entry]:
    entries = []
    for path, module in all_parts(modules):
        for table in module.tables:
            kind = module.plan[table.name].sharding_type
            config = module.data_parallel_optimizer if kind == ShardingType.DATA_PARALLEL else module.optimizer
            shards = []
            for kernel, kernel_shards in module.kernel_shards():
                states = kernel.shard_states()
                for k, shard in enumerate(kernel_shards):
                    if shard.table == table.name:
                        shards.append((shard, kernel.weights()[k], states[k]))
            key = f"{path}.{module.state_key(table.name)}" if path else module.state_key(table.name)
            entries.append(_Entry(key, module.groups, table.num_embeddings, table.embedding_dim, kind == ShardingType.COLUMN_WISE,
                                  kind == ShardingType.DATA_PARALLEL, config, shards))
    return entries


def _writers(entry: _Entry) -> bool:
    """Whether this rank writes its copy: replica group 0 of the table's part (data-parallel: rank 0)."""
    return dist.get_rank() == 0 if entry.data_parallel else entry.groups.replica_rank == 0


def sparse_save_state(modules: Mapping[str, ShardedCollection]) -> tuple[dict, dict]:
    """``(weights, optimizer state)`` of every table as :class:`Blocks`; no collective.

    The writers (``_writers``) hold their shards as blocks, every other rank none. A state of one number
    a row is saved ``[rows]``, or ``[rows, dim]`` (constant over each block) for a column-wise table,
    whose blocks keep separate ones; a state of one number an element ``[rows, dim]``.
    """
    weights, states = {}, {}
    for entry in _entries(modules):
        mine = entry.shards if _writers(entry) else []
        weights[entry.key] = Blocks(torch.Size([entry.rows, entry.dim]),
                                    [((s.row_start, s.col_start), w) for s, w, _ in mine])
        for name in entry.optimizer.state_shapes(0, 0):
            if not entry.per_row(name):
                local = [((s.row_start, s.col_start), st[name]) for s, _, st in mine]
                states[entry.state_key(name)] = Blocks(torch.Size([entry.rows, entry.dim]), local)
            elif entry.column_wise:
                local = [((s.row_start, s.col_start), st[name].unsqueeze(1).expand(-1, s.dim).contiguous())
                         for s, _, st in mine]
                states[entry.state_key(name)] = Blocks(torch.Size([entry.rows, entry.dim]), local)
            else:
                states[entry.state_key(name)] = Blocks(torch.Size([entry.rows]),
                                                       [((s.row_start,), st[name]) for s, _, st in mine])
    return weights, states


def accumulator_scales(modules: Mapping[str, ShardedCollection]) -> dict[str, float]:
    """``{table key: c}`` of every table with a row-wise accumulator (``layout.json``'s ``accumulator_scales``)."""
    return {entry.key: entry.scale for entry in _entries(modules) if entry.has_accumulator}


def table_optimizers(modules: Mapping[str, ShardedCollection]) -> dict[str, str]:
    """``{table key: name of its sparse optimizer}`` of every table (``layout.json``'s ``table_optimizers``)."""
    return {entry.key: entry.optimizer.name for entry in _entries(modules)}


def _saved_optimizers(path: Path) -> dict[str, str]:
    """``table_optimizers`` of the checkpoint at ``path`` (``{}`` where an earlier version wrote none)."""
    saved = json.loads((path / LAYOUT).read_text()).get("table_optimizers", {})
    names = (*OPTIMIZERS, *ADAM_OPTIMIZERS)
    if not isinstance(saved, dict) or not all(isinstance(name, str) and name in names for name in saved.values()):
        raise ValueError(f"{path / LAYOUT}: 'table_optimizers' must map table keys to sparse optimizers {names}, "
                         f"got {saved!r}")
    return saved


def _check_saved_optimizer(entry: _Entry, saved: Mapping[str, Any], path: Path) -> None:
    """Raise ``ValueError`` naming the table if the checkpoint at ``path`` (its ``table_optimizers``: ``saved``)
    saved it with an optimizer whose states differ from its optimizer's here (other names or shapes)."""
    name = saved.get(entry.key)
    if name is None:
        return

    def states(config: SparseOptimizerConfig) -> str:
        shapes = config.state_shapes(2, 3)
        return ", ".join(f"{state} [{'rows, dim' if len(shape) == 2 else 'rows'}]" for state, shape in shapes.items())

    if SparseOptimizerConfig(name).state_shapes(2, 3) != entry.optimizer.state_shapes(2, 3):
        raise ValueError(f"table {entry.key} was saved with sparse optimizer {name!r} in checkpoint {path}, which keeps "
                         f"{states(SparseOptimizerConfig(name)) or 'no state'}; {entry.optimizer.name!r} here keeps "
                         f"{states(entry.optimizer) or 'no state'}: resume with the optimizer it was saved with "
                         "(sparse_optimizer, or the table's sparse_per_table entry), or load the weights alone "
                         "(consolidate the checkpoint and load the state dict)")


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


def _ratio(entry: _Entry, scales: dict[str, float] | float | None) -> float | None:
    """``c_here / c_saved`` of the table's row-wise accumulator; None where ``c_saved`` is unknown."""
    if isinstance(scales, float):  # every table's
        return entry.scale / scales
    if scales is None or entry.key not in scales:
        return None
    return entry.scale / scales[entry.key]


def sparse_load_request(modules: Mapping[str, ShardedCollection], saved: Mapping[str, Any],
                        path: Path) -> tuple[dict[str, Blocks], Any]:
    """The blocks to read for this rank's shards (any saving mesh), and a function to call after reading.

    ``saved`` is the checkpoint's ``state_dict_metadata``. Weights load in place; optimizer states go
    through buffers that the returned function folds into the kernels' states: row-wise AdaGrad's
    accumulator times ``c_here / c_saved`` (``accumulator_scales``) where the two scales differ, the Adam
    family's states as saved (the module docstring says why).
    """
    request: dict[str, Blocks] = {}
    fixups = []
    scales, unknown = _saved_scales(path), []
    saved_optimizers = _saved_optimizers(path)
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
        _check_saved_optimizer(entry, saved_optimizers, path)
        ratio = 1.0
        if entry.has_accumulator:
            ratio = _ratio(entry, scales)
            unknown += [entry.key] if ratio is None and entry.scale != 1.0 else []
            ratio = 1.0 if ratio is None else ratio  # the scale it was saved with is unknown: as saved
        for name in entry.optimizer.state_shapes(0, 0):
            state_key = f"{SPARSE_STATE}.{entry.state_key(name)}"
            if state_key not in saved:
                held = sorted({k.rsplit(".", 1)[1] for k in saved if k.startswith(f"{SPARSE_STATE}.{entry.key}.")})
                raise KeyError(f"checkpoint {path} has no sparse optimizer state {state_key.rsplit('.', 1)[1]!r} for "
                               f"table {entry.key} (sparse_optimizer={entry.optimizer.name!r} keeps "
                               f"{list(entry.optimizer.state_shapes(0, 0))}; the checkpoint holds {held or 'none'}: it "
                               "was saved with another sparse optimizer); resume with the optimizer it was saved "
                               "with (sparse_optimizer, or the table's sparse_per_table entry), or load the weights "
                               "alone (consolidate the checkpoint and load the state dict)")
            per_column = entry.per_row(name) and len(saved[state_key].size) == 2
            buffers = []
            for shard, _, states in entry.shards:
                whole = not entry.per_row(name) or per_column
                shape, offsets = ((shard.rows, shard.dim), (shard.row_start, shard.col_start)) if whole \
                    else ((shard.rows,), (shard.row_start,))
                buffers.append((offsets, torch.zeros(shape, device=states[name].device)))
                fixups.append((states[name], buffers[-1][1], ratio, per_column))
            size = [entry.rows, entry.dim] if not entry.per_row(name) or per_column else [entry.rows]
            request[state_key] = Blocks(torch.Size(size), buffers)
    if unknown and dist.get_rank() == 0:
        warnings.warn(f"checkpoint {path} does not say by what its row-wise AdaGrad accumulators were divided "
                      f"(no 'accumulator_scales' in {LAYOUT}: an earlier version wrote it); those of {unknown} "
                      "load as saved, which keeps their step sizes only if it was written on this mesh (or with "
                      "the same numeric momentum_scale)", stacklevel=2)

    @torch.no_grad()
    def finalize() -> None:
        for state, buffer, ratio, per_column in fixups:
            if not per_column:
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
