"""Per-table sparse optimizer settings: the strategies' ``sparse_per_table`` option.

A table's entry overrides some of the strategy-wide settings; each key is the strategy option without its
``sparse_`` prefix, as TorchRec's per-table fused parameters override its sharder's::

    sparse_per_table={"t_big": {"optimizer": "rowwise_adam", "lr": 1e-3, "betas": (0.9, 0.99)},
                      "t_small": {"lr": 0.1}}

``OptimizerSettings`` is one table's settings before its layout fixes ``momentum_scale="auto"``
(``on_layout``). Tables whose settings differ train in kernels of their own (``wrap.split_twin``): each
kernel, its checkpoint entries and its replica rounds keep one ``SparseOptimizerConfig``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_twod.sparse.optimizers import SparseOptimizerConfig, layout_optimizer

#: Keys of a ``sparse_per_table`` entry -> the strategy option each overrides.
TABLE_KEYS = {"optimizer": "sparse_optimizer", "lr": "sparse_lr", "eps": "sparse_eps", "betas": "sparse_betas",
              "weight_decay": "sparse_weight_decay", "momentum_scale": "momentum_scale"}
#: TorchRec's fused-parameter names -> the key that takes their value here.
TORCHREC_KEYS = {"learning_rate": "lr", "beta1": "betas", "beta2": "betas", "name": "optimizer", "optim": "optimizer"}


@dataclass(frozen=True)
class OptimizerSettings:
    """The sparse optimizer of one table (or the strategy-wide one), ``momentum_scale`` a number or ``"auto"``."""

    optimizer: str = "momentum_rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    momentum_scale: float | str = "auto"

    def on_layout(self, *, data_parallel: bool, world_size: int, shard_group_size: int,
                  sync_mode: str) -> SparseOptimizerConfig:
        """The config of a table with these settings on a layout (``optimizers.layout_optimizer``)."""
        return layout_optimizer(self.optimizer, self.lr, self.eps, self.momentum_scale, data_parallel=data_parallel,
                                world_size=world_size, shard_group_size=shard_group_size, sync_mode=sync_mode,
                                betas=self.betas, weight_decay=self.weight_decay)

    def unscaled(self) -> SparseOptimizerConfig:
        """The config of these settings, ``momentum_scale`` 1 where it is ``"auto"``: the form of the update, what
        checks and the kernel backend's choice read (raises ``ValueError`` for settings the optimizer refuses)."""
        scale = 1.0 if self.momentum_scale == "auto" else self.momentum_scale
        return SparseOptimizerConfig(self.optimizer, self.lr, self.eps, scale, beta1=self.betas[0], beta2=self.betas[1],
                                     weight_decay=self.weight_decay)

    def describe(self, other: OptimizerSettings | None = None) -> str:
        """``"optimizer='rowwise_adam', lr=0.001"``: the settings (those that differ from ``other``'s), by key."""
        return ", ".join(f"{key}={getattr(self, key)!r}" for key in TABLE_KEYS
                         if other is None or getattr(self, key) != getattr(other, key))


def table_settings(default: OptimizerSettings, entry: Any, table: str) -> OptimizerSettings:
    """``default`` with the keys of ``table``'s ``sparse_per_table`` entry; raises ``ValueError`` naming the table,
    the key and the fix, also for settings the optimizer refuses (a weight decay of ``rowwise_adagrad``)."""
    where = f"sparse_per_table[{table!r}]"
    if not isinstance(entry, Mapping) or not entry:
        raise ValueError(f"{where}={entry!r}; use a mapping of the settings it overrides, e.g. "
                         "{'optimizer': 'rowwise_adam', 'lr': 0.001}, with keys " + ", ".join(TABLE_KEYS))
    unknown = [key for key in entry if key not in TABLE_KEYS]
    if unknown:
        hints = [f"{key!r} is TorchRec's; here it is {TORCHREC_KEYS[key]!r}" for key in unknown if key in TORCHREC_KEYS]
        raise ValueError(f"{where}: unknown key(s) {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
                         + f"; use {', '.join(TABLE_KEYS)} (the strategy options without their sparse_ prefix)")
    values = dict(entry)
    if "betas" in values:
        betas = values["betas"]
        if not (isinstance(betas, tuple | list) and len(betas) == 2):
            raise ValueError(f"{where}: betas={betas!r}; use two numbers (beta1, beta2), e.g. (0.9, 0.999)")
        values["betas"] = tuple(betas)
    settings = dataclasses.replace(default, **values)
    scale = settings.momentum_scale
    if scale != "auto" and not (_number(scale) and scale > 0):
        raise ValueError(f"{where}: momentum_scale={scale!r}; use a number > 0 or 'auto'")
    for key in ("lr", "eps", "weight_decay", *(("betas",) if "betas" in values else ())):
        numbers = settings.betas if key == "betas" else (getattr(settings, key),)
        if not all(_number(n) for n in numbers):
            raise ValueError(f"{where}: {key}={getattr(settings, key)!r}; use a number")
    try:  # a key the entry leaves out is the strategy's (e.g. its sparse_weight_decay): named as the entry's
        settings.unscaled()
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return settings


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
