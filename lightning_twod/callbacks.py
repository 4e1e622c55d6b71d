"""``TrafficMonitor``: bytes moved per training step, inside and across shard groups, per rank."""

from __future__ import annotations

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class TrafficMonitor(pl.Callback):
    """Logs ``traffic/intra_MB_per_step`` and ``traffic/cross_MB_per_step`` and prints a per-rank
    table at the end of fit. ``intra``: bytes sent to ranks of the same shard group (all-to-all);
    ``cross``: to other ranks (the cross-group reduction). Needs ``TwoDSparseStrategy``."""

    def __init__(self) -> None:
        self.start: dict[str, int] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = dict(trainer.strategy.traffic())
        self.start_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        steps = max(1, trainer.global_step - self.start_step)
        now = strategy.traffic()
        mine = {k: (now[k] - self.start[k]) / steps for k in now}
        mine["by_collective"] = {k: v / steps for k, v in strategy.byte_counter.by_name().items()}
        rows = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rows = [None] * dist.get_world_size()
            dist.all_gather_object(rows, mine)
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
