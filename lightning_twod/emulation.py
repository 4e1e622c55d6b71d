"""The training arithmetic of ``TwoDSparseStrategy`` on ``W`` ranks, computed in one process.

Quality studies need many runs (layouts x optimizers x learning rates x seeds). The quality of a
run depends only on its arithmetic, which this emulator reproduces for table-wise/row-wise
tables without processes or collectives (tests check it against real multi-process runs):

* rank ``r`` of ``W`` gets its slice of the global batch; rank ``r`` belongs to replica group
  ``r // S`` (contiguous placement: which ranks share a group decides which samples are pooled);
* dense parameters: one copy, stepped by the user's optimizer on the mean of the ``W`` ranks'
  gradients (what DDP computes);
* every replica group ``i`` has its own copy of the tables and row-wise state; its gradient is the
  mean over its ``S`` ranks (the ``1 / S`` output-dist scaling); in ``sync_mode="weights"`` each copy
  takes its own sparse step and every ``sync_interval`` steps all copies are averaged (averaging
  whole tables equals the touched-rows reduction: untouched rows are equal); in
  ``sync_mode="gradients"`` the copies' gradients are averaged first and all take the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_twod.optim.rowwise_adagrad import SparseOptimizerConfig, sparse_update
from lightning_twod.sparse.wrap import find_embedding_modules


@dataclass(frozen=True)
class EmulatedLayout:
    """``world_size`` ranks in groups of ``shard_group_size``; how the groups are kept in sync."""

    world_size: int
    shard_group_size: int
    sync_mode: str = "weights"
    sync_interval: int = 1

    def __post_init__(self) -> None:
        if self.world_size % self.shard_group_size:
            raise ValueError(f"shard_group_size={self.shard_group_size} does not divide world_size={self.world_size}")
        if self.sync_mode not in ("weights", "gradients"):
            raise ValueError(f"sync_mode={self.sync_mode!r}; use 'weights' or 'gradients'")

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.shard_group_size


class MeshEmulator:
    """Trains ``model`` (unsharded) as ``TwoDSparseStrategy`` would on ``layout``.

    ``loss_fn(model, batch)`` returns the mean loss of a local batch; ``dense_optimizer`` builds the
    dense optimizer from the dense parameters (the user's ``configure_optimizers`` minus tables).
    """

    def __init__(self, model: nn.Module, layout: EmulatedLayout, sparse: SparseOptimizerConfig,
                 loss_fn: Callable[[nn.Module, dict], Tensor],
                 dense_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.model, self.layout, self.sparse, self.loss_fn = model, layout, sparse, loss_fn
        self.tables: dict[str, nn.Parameter] = {}
        for path, module in find_embedding_modules(model):
            for name, param in module.named_parameters():
                self.tables[f"{path}.{name}" if path else name] = param
        table_ids = {id(p) for p in self.tables.values()}
        self.dense = [p for p in model.parameters() if id(p) not in table_ids]
        self.optimizer = dense_optimizer(self.dense)
        copies = 1 if layout.sync_mode == "gradients" else layout.num_replicas
        self.replicas = [{k: p.detach().clone() for k, p in self.tables.items()} for _ in range(copies)]
        self.states = [{k: torch.zeros(p.shape[0]) for k, p in self.tables.items()} for _ in range(copies)]
        self.steps = 0

    def _use(self, replica: int) -> None:
        for key, param in self.tables.items():
            param.data = self.replicas[replica][key]

    def step(self, rank_batches: Sequence[dict]) -> float:
        """One optimizer step on ``W`` local batches (rank order); returns the mean loss."""
        layout = self.layout
        assert len(rank_batches) == layout.world_size, f"need {layout.world_size} local batches"
        self.optimizer.zero_grad(set_to_none=True)
        size, total = layout.shard_group_size, 0.0
        grads = []
        for group in range(layout.num_replicas):
            self._use(0 if layout.sync_mode == "gradients" else group)
            for param in self.tables.values():
                param.grad = None
            for rank in range(group * size, (group + 1) * size):
                loss = self.loss_fn(self.model, rank_batches[rank])
                (loss / layout.world_size).backward()  # dense: the mean over all ranks
                total += float(loss.detach())
            # tables: the mean over the group's ranks, i.e. M times what the world mean gave
            grads.append({k: p.grad * layout.num_replicas for k, p in self.tables.items() if p.grad is not None})
        self.optimizer.step()
        if layout.sync_mode == "gradients":
            mean = {k: sum(g[k] for g in grads) / len(grads) for k in grads[0]}
            self._sparse_step(0, mean)
        else:
            for group, grad in enumerate(grads):
                self._sparse_step(group, grad)
        self.steps += 1
        if layout.sync_mode == "weights" and self.steps % layout.sync_interval == 0:
            self.average_replicas()
        self._use(0)
        return total / layout.world_size

    @torch.no_grad()
    def _sparse_step(self, replica: int, grads: dict[str, Tensor]) -> None:
        for key, grad in grads.items():
            rows = grad.abs().sum(dim=1).nonzero().squeeze(1)  # zero-gradient rows are no-ops anyway
            state = self.states[replica][key] if self.sparse.has_state else None
            sparse_update(self.sparse, self.replicas[replica][key], state, rows, grad[rows])

    @torch.no_grad()
    def average_replicas(self) -> None:
        """The cross-group reduction: every copy becomes the mean of the copies."""
        for copies in (self.replicas, self.states):
            for key in copies[0]:
                mean = torch.stack([c[key] for c in copies]).mean(dim=0)
                for c in copies:
                    c[key] = mean.clone()
        self._use(0)
