"""Cross-group reduction: keep the copies of every shard consistent over the replica axis.

Copies are identical right after a reduction, so only rows that some copy looked up since then
can differ. Both reductions therefore first share the touched row ids over the group (an
all-gather of ``[u_k]`` ids per shard) and then move only those rows:

* ``average_touched_rows`` (``sync_mode="weights"``): all-reduce the weights ``[u, D]`` and the
  row-wise optimizer state ``[u]`` of the union of touched rows and divide by the group size.
  Equals averaging whole tables, at a cost that scales with the rows touched, not table size.
* ``reduce_sparse_gradients`` (``sync_mode="gradients"``): all-reduce the touched rows' gradients
  before the update, so every copy applies the same update (exactly 1D training).

The group is the replica group for sharded tables and the whole world for data-parallel tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.sparse.comm import ByteCounter, group_size
from lightning_twod.sparse.kernels import LookupKernel, TorchKernel


@dataclass
class ReplicatedKernel:
    """A kernel whose shards have a copy on every member of ``group`` (global ranks ``peers``)."""

    kernel: LookupKernel
    group: ProcessGroup | None
    peers: list[int]


def _count_allreduce(counter: ByteCounter | None, name: str, peers: Sequence[int], nbytes: int) -> None:
    # A ring all-reduce sends 2 (M - 1) / M of the buffer in all, spread evenly over the M - 1 peers.
    if counter is not None and len(peers) > 1:
        counter.add(name, peers, [2 * nbytes // len(peers)] * len(peers))


def union_over_group(
    rows: Sequence[Tensor], group: ProcessGroup | None, counter: ByteCounter | None = None,
    peers: Sequence[int] = (), name: str = "replica_sync",
) -> list[Tensor]:
    """Per shard, the sorted union ``[u_k]`` of the row ids ``rows[k]`` of every group member."""
    size = group_size(group)
    if size == 1:
        return [torch.unique(r) for r in rows]
    device = rows[0].device
    counts = torch.tensor([r.numel() for r in rows], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(size)]
    dist.all_gather(all_counts, counts, group=group)
    longest = max(int(c.sum()) for c in all_counts)
    padded = torch.zeros(longest, dtype=torch.int64, device=device)
    flat = torch.cat(list(rows))
    padded[: flat.numel()] = flat
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    if counter is not None:
        counter.add(name, peers, [(counts.numel() + flat.numel()) * 8] * len(peers))
    per_member = [torch.split(g[: int(c.sum())], c.tolist()) for g, c in zip(gathered, all_counts, strict=True)]
    return [torch.unique(torch.cat([member[k] for member in per_member])) for k in range(len(rows))]


@torch.no_grad()
def average_touched_rows(replicated: ReplicatedKernel, counter: ByteCounter | None = None) -> int:
    """Average the touched rows (weights and optimizer state) over the group; returns rows moved."""
    kernel = replicated.kernel
    touched = kernel.take_touched()
    size = group_size(replicated.group)
    if size == 1:
        return 0
    rows = union_over_group(touched, replicated.group, counter, replicated.peers)
    weights, states = kernel.weights(), kernel.optimizer_states()
    state_rows = rows if states else []  # SGD keeps no row state
    parts = [w[r].flatten() for w, r in zip(weights, rows, strict=True)]
    parts += [s[r] for s, r in zip(states, state_rows, strict=True)]
    flat = torch.cat(parts) if parts else None
    if flat is None or flat.numel() == 0:
        return 0
    dist.all_reduce(flat, group=replicated.group)
    flat /= size
    _count_allreduce(counter, "replica_sync", replicated.peers, flat.numel() * flat.element_size())
    pieces = iter(torch.split(flat, [p.numel() for p in parts]))
    for w, r in zip(weights, rows, strict=True):
        w.index_copy_(0, r, next(pieces).view(-1, w.shape[1]))
    for s, r in zip(states, state_rows, strict=True):
        s.index_copy_(0, r, next(pieces))
    return sum(r.numel() for r in rows)


@torch.no_grad()
def reduce_sparse_gradients(
    replicated: ReplicatedKernel, counter: ByteCounter | None = None
) -> list[tuple[Tensor, Tensor] | None]:
    """Mean of each shard's sparse gradient over the group: per shard ``(rows [u], grads [u, D])``."""
    kernel = replicated.kernel
    if not isinstance(kernel, TorchKernel):
        raise TypeError("sync_mode='gradients' needs the torch kernel backend (FBGEMM updates rows in backward)")
    kernel.take_touched()  # the gradients name the touched rows themselves
    local = kernel.sparse_gradients()
    size = group_size(replicated.group)
    if size == 1:
        return local
    empty = torch.zeros(0, dtype=torch.int64, device=kernel.device())
    rows = union_over_group([g[0] if g is not None else empty for g in local], replicated.group, counter,
                            replicated.peers, name="replica_grad_sync")
    dense = []
    for (shape, r, g) in zip(kernel.shapes, rows, local, strict=True):
        block = torch.zeros(r.numel(), shape.dim, device=r.device)
        if g is not None:
            block.index_add_(0, torch.searchsorted(r, g[0]), g[1])
        dense.append(block)
    flat = torch.cat([d.flatten() for d in dense])
    dist.all_reduce(flat, group=replicated.group)
    flat /= size
    _count_allreduce(counter, "replica_grad_sync", replicated.peers, flat.numel() * flat.element_size())
    blocks = torch.split(flat, [d.numel() for d in dense])
    return [(r, b.view(-1, shape.dim)) for r, b, shape in zip(rows, blocks, kernel.shapes, strict=True)]


@torch.no_grad()
def average_whole_tables(replicated: ReplicatedKernel) -> None:
    """Reference reduction: average every row of every shard over the group (what TorchRec does)."""
    size = group_size(replicated.group)
    if size == 1:
        return
    for tensor in [*replicated.kernel.weights(), *replicated.kernel.optimizer_states()]:
        dist.all_reduce(tensor, group=replicated.group)
        tensor /= size
