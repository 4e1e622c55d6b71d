"""Callbacks: ``TrafficMonitor`` (bytes moved per training step, inside and across shard groups),
``TwoDModelSummary`` (Lightning's model summary plus the sharded embedding rows) and
``PredictionWriter`` (``trainer.predict``'s outputs to a CSV or ``.pt`` file)."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_human_readable_count,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_twod.distributed.groups import has_process_group


def _distributed() -> bool:
    return has_process_group() and dist.get_world_size() > 1


def _gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order, on every rank (a collective of the default process group)."""
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _gather_to_zero(obj: Any) -> list[Any] | None:
    """``obj`` of every rank, in rank order, on rank 0; ``None`` on the other ranks (a collective)."""
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class TrafficMonitor(pl.Callback):
    """Bytes sent per training step at the end of fit: ``intra``, to ranks of the same shard group
    (the all-to-all); ``cross``, to other ranks (the cross-group reduction). Needs ``TwoDSparseStrategy``.

    Prints a per-rank table and the total per collective, and logs the same numbers through the
    Trainer's loggers (at the last step): ``traffic/intra_MB_per_step`` and
    ``traffic/cross_MB_per_step`` (mean over the ranks), ``traffic/rank{r}/intra_MB_per_step`` and
    ``traffic/rank{r}/cross_MB_per_step`` per rank, ``traffic/{collective}_MB_per_step`` (all ranks).
    """

    def __init__(self) -> None:
        self.start: dict[str, int] | None = None
        self.start_by_collective: dict[str, int] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = dict(trainer.strategy.traffic())
        self.start_by_collective = dict(trainer.strategy.byte_counter.by_name())
        self.start_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        steps = max(1, trainer.global_step - self.start_step)
        now = strategy.traffic()
        mine = {k: (now[k] - self.start[k]) / steps for k in now}
        mine["by_collective"] = {k: (v - self.start_by_collective.get(k, 0)) / steps
                                 for k, v in strategy.byte_counter.by_name().items()}
        rows = _gather_objects(mine)
        groups = strategy.mesh_groups
        lines = [f"bytes sent per training step ({steps} steps; intra = inside the rank's shard group)",
                 f"  {'rank':>4} {'shard group':>12} {'intra KB':>10} {'cross KB':>10}"]
        for rank, row in enumerate(rows):
            group = groups.dims.coords(rank)[0]
            lines.append(f"  {rank:>4} {group:>12} {row['intra'] / 1e3:>10.1f} {row['cross'] / 1e3:>10.1f}")
        names = sorted({n for row in rows for n in row["by_collective"]})
        totals = {n: sum(row["by_collective"].get(n, 0) for row in rows) / 1e3 for n in names}
        lines.append("  all ranks, by collective (KB/step): " + ", ".join(f"{n} {v:.1f}" for n, v in totals.items()))
        rank_zero_info("\n".join(lines))
        metrics = {f"traffic/{kind}_MB_per_step": sum(row[kind] for row in rows) / len(rows) / 1e6
                   for kind in ("intra", "cross")}
        for rank, row in enumerate(rows):
            metrics.update({f"traffic/rank{rank}/{kind}_MB_per_step": row[kind] / 1e6 for kind in ("intra", "cross")})
        metrics.update({f"traffic/{name}_MB_per_step": kb / 1e3 for name, kb in totals.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


@dataclass
class EmbeddingCount:
    """Embedding rows and values of one sharded collection: ``rows`` and ``params`` of the whole
    tables (one copy of the model), ``rank_rows`` and ``rank_params`` held by each rank (its shards
    and full copies of data-parallel tables; a column-wise shard counts its rows once per shard)."""

    tables: int
    rows: int
    params: int
    rank_rows: list[int]
    rank_params: list[int]


class TwoDModelSummary(ModelSummary):
    """Lightning's model summary, with the embedding rows of the sharded collections counted.

    The sharded twins hold their rows outside the module tree (so that DDP and the dense optimizer
    never see them), and Lightning's summary would count only the dense parameters. This one adds
    each collection's parameters to its layer's ``Params`` and to the totals, and lists its rows and
    values for the whole tables and for every rank. ``embedding_counts`` (``{attribute path:
    EmbeddingCount}``) keeps the numbers. ``TwoDSparseStrategy`` installs it in place of Lightning's
    default summary (and of a plain ``ModelSummary`` given by the user, keeping its ``max_depth``);
    unsharded models are summarized as by Lightning.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.embedding_counts: dict[str, EmbeddingCount] = {}

    @staticmethod
    def install(trainer: pl.Trainer) -> None:
        """Replace the Trainer's ``ModelSummary`` / ``RichModelSummary`` (exact types) by this class."""
        for i, callback in enumerate(trainer.callbacks):
            if type(callback) in (ModelSummary, RichModelSummary):
                trainer.callbacks[i] = TwoDModelSummary(callback._max_depth, **callback._summarize_kwargs)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        twins = getattr(trainer.strategy, "sparse_modules", {})
        if not self._max_depth or not twins:
            super().on_fit_start(trainer, pl_module)
            return
        held = {path: [pair for part in twin.parts() for pair in part.local_shards()] for path, twin in twins.items()}
        mine = {path: (sum(shard.rows for shard, _ in pairs), sum(weight.numel() for _, weight in pairs))
                for path, pairs in held.items()}
        ranks = _gather_objects(mine)  # every rank takes part: on_fit_start runs on all of them
        tables = {path: twin.output_tables() for path, twin in twins.items()}
        self.embedding_counts = {
            path: EmbeddingCount(len(tables[path]), sum(t.num_embeddings for t in tables[path]),
                                 sum(t.num_embeddings * t.embedding_dim for t in tables[path]),
                                 [rank[path][0] for rank in ranks], [rank[path][1] for rank in ranks])
            for path, twin in twins.items()
        }
        if trainer.is_global_zero:
            rank_zero_info("\n" + self._table(pl_module, twins))

    def _table(self, pl_module: pl.LightningModule, twins: Mapping[str, Any]) -> str:
        summary = self._summary(pl_module.trainer, pl_module)
        data = summary._get_summary_data()
        columns = dict(data)
        for i, name in enumerate(columns["Name"]):
            inside = [c.params for path, c in self.embedding_counts.items()
                      if path == name or path.startswith(name + ".")]
            if inside:
                columns["Params"][i] = get_human_readable_count(summary.param_nums[i] + sum(inside))
        params = sum(c.params for c in self.embedding_counts.values())
        itemsize = next((w.element_size() for twin in twins.values() for _, w in twin.local_shards()), 4)
        table = _format_summary_table(summary.total_parameters + params, summary.trainable_parameters + params,
                                      summary.model_size + params * itemsize / 1e6, summary.total_training_modes,
                                      getattr(summary, "total_flops", 0), *data)
        lines = [table, "Embedding rows (sharded, held outside the module tree, trained by the sparse optimizer):"]
        for path, c in self.embedding_counts.items():
            per_rank = ", ".join(f"{r}: {rows:,} / {get_human_readable_count(p).strip()}"
                                 for r, (rows, p) in enumerate(zip(c.rank_rows, c.rank_params)))
            lines.append(f"  {path}: {c.tables} tables, {c.rows:,} rows, "
                         f"{get_human_readable_count(c.params).strip()} params; per rank (rows / params): {per_rank}")
        return "\n".join(lines)


class PredictionWriter(BasePredictionWriter):
    """Writes what ``predict_step`` returns to a file: ``.csv`` (a header, one row per sample) or
    ``.pt`` (``{column: tensor}``, read with ``torch.load``).

    Each ``predict_step`` output must be a mapping of 1-D tensors of one length ``[B]``, e.g. the
    DLRM's ``index``, ``logit``, ``probability``, ``label``. Without an ``index``, Lightning's
    sample indices of the batch are used (map-style data sets only).

    Args:
        path: the file; default ``<trainer.default_root_dir>/predictions.csv``. With several predict
            dataloaders, dataloader ``i > 0`` writes ``<stem>.dataloader{i}<suffix>``.
        per_rank: ``False`` (default): at the end of the epoch every rank sends its predictions to
            rank 0, which writes ONE file, rows sorted by ``index``. ``True``: every rank writes its
            own file, ``<stem>.rank{r}<suffix>``, rows in the order it predicted them, with no
            communication (for predictions too large for one process).

    ``written``: the files this rank wrote in the last ``predict``.
    """

    def __init__(self, path: str | None = None, per_rank: bool = False) -> None:
        super().__init__(write_interval="batch")
        if path is not None and Path(path).suffix not in (".csv", ".pt"):
            raise ValueError(f"PredictionWriter: path={path!r} must end in .csv or .pt")
        self.path, self.per_rank = path, per_rank
        self.written: list[Path] = []
        self._parts: dict[int, list[dict[str, Tensor]]] = {}

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._parts, self.written = {}, []

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        if not isinstance(prediction, Mapping):
            raise TypeError(f"PredictionWriter: predict_step returned {type(prediction).__name__}; return a "
                            "mapping of 1-D tensors, e.g. {'index': ..., 'logit': ...}")
        columns = {k: torch.as_tensor(v).detach().cpu() for k, v in prediction.items()}
        if "index" not in columns:
            if not batch_indices:
                raise ValueError("PredictionWriter: predict_step returned no 'index' and Lightning tracked no "
                                 "sample indices (an iterable data set); return an 'index' from predict_step")
            columns = {"index": torch.as_tensor(batch_indices, dtype=torch.int64), **columns}
        lengths = {k: tuple(v.shape) for k, v in columns.items()}
        if any(len(shape) != 1 or shape != lengths["index"] for shape in lengths.values()):
            raise ValueError(f"PredictionWriter: predict_step must return 1-D tensors of one length; got {lengths}")
        self._parts.setdefault(dataloader_idx, []).append(columns)

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        base = Path(self.path) if self.path is not None else Path(trainer.default_root_dir) / "predictions.csv"
        loaders = sorted(self._parts) if self.per_rank else sorted(set().union(*_gather_objects(list(self._parts))))
        for loader in loaders:
            path = base if loader == 0 else base.with_name(f"{base.stem}.dataloader{loader}{base.suffix}")
            columns = _concat(self._parts.get(loader, []))
            if self.per_rank:
                self._write(path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}"), columns)
                continue
            parts = _gather_to_zero(columns)
            if parts is not None:
                merged = _concat([p for p in parts if p]) or {"index": torch.zeros(0, dtype=torch.int64)}
                order = torch.argsort(merged["index"], stable=True)
                self._write(path, {k: v[order] for k, v in merged.items()})
        self._parts = {}

    def _write(self, path: Path, columns: dict[str, Tensor]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".pt":
            torch.save(columns, path)
        else:
            with path.open("w", newline="") as file:
                writer = csv.writer(file)
                writer.writerow(list(columns))
                writer.writerows(zip(*[_csv_column(v) for v in columns.values()]))
        self.written.append(path)
        rank_zero_info(f"PredictionWriter: wrote {len(columns['index']):,} predictions to {path}")


def _concat(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    if not parts:
        return {}
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _csv_column(values: Tensor) -> list:
    if values.is_floating_point():
        return [f"{v:.9g}" for v in values.tolist()]
    return values.tolist()
