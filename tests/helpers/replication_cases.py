"""A small replicated kernel: two shards (``SHAPES``) read by three features (``SLOTS``), random
weights and optimizer state (row-wise AdaGrad's by default; ``make_kernel``), and what a training lookup reports to the
kernel's observers (``look_up``); ``nudge`` moves one element of a copy by one ulp."""

from __future__ import annotations

import torch

from lightning_twod.sparse.kernels import ShardShape, TorchKernel
from lightning_twod.sparse.optimizers import SparseOptimizerConfig

SHAPES = [ShardShape(40, 4), ShardShape(8, 2)]  # shard 1: small, so that most of it is touched
SLOTS = [0, 1, 0]  # three features: shard 0 read by two of them


def make_kernel(shapes: list[ShardShape] = SHAPES, slots: list[int] = SLOTS,
                optimizer: str = "rowwise_adagrad") -> TorchKernel:
    """A pooled kernel over ``shapes`` read by ``slots``: weights ``randn``, every state ``rand`` (seed 0)."""
    kernel = TorchKernel(shapes, slots, pooled=True, optimizer=SparseOptimizerConfig(optimizer))
    torch.manual_seed(0)
    for weight in kernel.weights():
        weight.copy_(torch.randn_like(weight))
    for states in kernel.shard_states():
        for state in states.values():
            state.copy_(torch.rand_like(state))
    return kernel


def look_up(kernel: TorchKernel, rows_per_slot: list[list[int]]) -> None:
    """What a training lookup reports to the kernel's observers: one bag per slot."""
    values = torch.tensor([r for rows in rows_per_slot for r in rows], dtype=torch.int64)
    lengths = torch.tensor([len(rows) for rows in rows_per_slot], dtype=torch.int64)
    kernel.train()
    with torch.enable_grad():
        kernel._observe(values, lengths)


def nudge(tensor: torch.Tensor) -> float:
    """Move element 0 of ``tensor`` up by one ulp, in place; returns its old value."""
    index = (0,) * tensor.dim()
    old = tensor[index].clone()
    tensor[index] = torch.nextafter(old, torch.tensor(float("inf")))
    return float(old)
