"""Sparse optimizers for embedding rows: SGD, row-wise AdaGrad and its momentum-scaled form.

Row-wise AdaGrad keeps one accumulator per row (not per element)::

    v[row] += mean(g[row] ** 2)                       # over the row's D columns
    w[row] -= lr * g[row] / (sqrt(v[row] / c) + eps)  # c = momentum scale; c = 1 is plain AdaGrad

The layout makes a row's accumulator grow ``c`` times faster than in 1D training
(``layout_momentum_scale``): ``M`` for sharded tables, ``W`` for data-parallel tables, 1 when the
replicas average gradients; dividing by that ``c`` undoes it. Since
``lr * g / (sqrt(v / c) + eps) == (lr * sqrt(c)) * g / (sqrt(v) + eps * sqrt(c))`` the scaled form
runs on any plain row-wise AdaGrad kernel (FBGEMM's included) with ``lr`` and ``eps`` rescaled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

OPTIMIZERS = ("sgd", "rowwise_adagrad", "momentum_rowwise_adagrad")


@dataclass(frozen=True)
class SparseOptimizerConfig:
    """How embedding rows are updated; one config per sharded collection."""

    name: str = "momentum_rowwise_adagrad"
    """``"sgd"``, ``"rowwise_adagrad"`` or ``"momentum_rowwise_adagrad"`` (the strategies' default;
    with the default ``momentum_scale`` of 1 it is exactly ``"rowwise_adagrad"``)."""
    lr: float = 0.01
    eps: float = 1e-8
    momentum_scale: float = 1.0
    """Accumulator divisor ``c``; used by ``"momentum_rowwise_adagrad"`` only."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown sparse optimizer {self.name!r}; use one of {OPTIMIZERS}")
        if not self.lr > 0 or not self.eps >= 0:
            raise ValueError(f"sparse optimizer needs lr > 0 and eps >= 0, got lr={self.lr}, eps={self.eps}")
        if not self.momentum_scale > 0:
            raise ValueError(f"momentum_scale must be > 0, got {self.momentum_scale}")

    @property
    def has_state(self) -> bool:
        """Whether a per-row accumulator ``[rows]`` is kept."""
        return self.name != "sgd"

    @property
    def accumulator_scale(self) -> float:
        """``c``: the step divides the accumulator by it (1 unless ``momentum_rowwise_adagrad``)."""
        return self.momentum_scale if self.name == "momentum_rowwise_adagrad" else 1.0

    def rowwise_lr_eps(self) -> tuple[float, float]:
        """``(lr, eps)`` of the plain row-wise AdaGrad that equals this config."""
        scale = self.accumulator_scale
        return self.lr * math.sqrt(scale), self.eps * math.sqrt(scale)


def layout_momentum_scale(data_parallel: bool, world_size: int, shard_group_size: int, sync_mode: str) -> float:
    """The factor ``c`` by which a layout makes a row's accumulator grow faster than in 1D training.

    1D's gradient of a row is the mean over all ``W`` ranks' local-batch gradients. A sharded table's
    copy takes the mean over its ``S`` ranks (the output dist's ``1 / S``), so a row that only one
    replica group saw gets ``M = W / S`` times the 1D gradient, ``M**2`` times its square, and the
    accumulator averaged over the ``M`` copies grows ``M`` times faster. A data-parallel table's copy
    takes its own rank's gradient, ``W`` times the 1D one, and its copies are averaged over ``W``:
    ``W`` times faster. With ``sync_mode="gradients"`` the copies apply the averaged gradient, which
    is the 1D gradient: ``c = 1``.
    """
    if sync_mode == "gradients":
        return 1.0
    return float(world_size if data_parallel else world_size // shard_group_size)


def layout_optimizer(name: str, lr: float, eps: float, momentum_scale: float | str, *, data_parallel: bool,
                     world_size: int, shard_group_size: int, sync_mode: str) -> SparseOptimizerConfig:
    """The config of one kind of table on one layout; ``momentum_scale="auto"``: ``layout_momentum_scale``.

    A number is used as it is, for every kind of table.
    """
    scale = (layout_momentum_scale(data_parallel, world_size, shard_group_size, sync_mode)
             if momentum_scale == "auto" else float(momentum_scale))
    return SparseOptimizerConfig(name, lr, eps, scale)


def coalesce_rows(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Sum gradient rows that hit the same row: ``rows`` [n], ``grads`` [n, D] -> unique [u], [u, D]."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = grads.new_zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    return unique, summed


@torch.no_grad()
def sparse_update(
    config: SparseOptimizerConfig, weight: Tensor, state: Tensor | None, rows: Tensor, grads: Tensor
) -> None:
    """Apply one step in place to the given rows.

    ``weight`` [R, D]; ``state`` [R] accumulator (None for SGD); ``rows`` [u] unique row ids;
    ``grads`` [u, D] their summed gradients.
    """
    if rows.numel() == 0:
        return
    grads = grads.to(weight.dtype)
    if config.name == "sgd":
        weight.index_add_(0, rows, grads, alpha=-config.lr)
        return
    assert state is not None, "row-wise AdaGrad needs its accumulator"
    accumulated = state[rows] + grads.pow(2).mean(dim=1)
    state[rows] = accumulated
    step = config.lr / ((accumulated / config.accumulator_scale).sqrt() + config.eps)
    weight.index_add_(0, rows, grads * step.unsqueeze(1), alpha=-1.0)
