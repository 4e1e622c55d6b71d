"""``sync_mode="gradients"``: the touched rows' gradients averaged over the copies before the update.

Every copy then applies the same update with the mean gradient, which is the 1D gradient: exactly
1D training under any optimizer, at the cost of a cross-group exchange every step. The copies
first share the ids of the rows they touched (an all-gather of ``[u_k]`` ids per shard), then
all-reduce the gradients of the union of those rows.

A NaN or inf gradient on one copy would be averaged into every copy's update: ``step_with_mean_gradients``
updates nothing unless every mean is finite on every rank, and otherwise raises ``NonFiniteError`` on
every rank, naming the tables and the ranks. What it costs: one pass over each mean (the sum is NaN
or inf exactly where one copy's gradient is, so the group's verdict rides its all-reduce), read with
one host synchronization a step, and one all-reduce of one number a step over the mesh's shard
group, which makes the replica groups' verdicts one for the world (``reducer``: measured costs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.distributed.groups import group_size
from lightning_twod.replication.reducer import ReplicatedKernel, agree_finite, count_all_reduce, raise_nonfinite
from lightning_twod.sparse.kernels import TorchKernel, nonfinite_mark


def union_over_group(
    rows: Sequence[Tensor], group: ProcessGroup | None, counter: ByteCounter | None = None,
    peers: Sequence[int] = (), name: str = "replica_grad_sync",
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
def reduce_sparse_gradients(
    replicated: ReplicatedKernel, counter: ByteCounter | None = None
) -> list[tuple[Tensor, Tensor] | None]:
    """Mean of each shard's sparse gradient over the group: per shard ``(rows [u], grads [u, D])``."""
    kernel = replicated.kernel
    if not isinstance(kernel, TorchKernel):
        raise TypeError("sync_mode='gradients' needs the torch kernel backend (FBGEMM updates rows in backward)")
    local = kernel.sparse_gradients()
    size = group_size(replicated.group)
    if size == 1:
        return local
    empty = torch.zeros(0, dtype=torch.int64, device=kernel.device())
    rows = union_over_group([g[0] if g is not None else empty for g in local], replicated.group, counter,
                            replicated.peers)
    dense = []
    for (shape, r, g) in zip(kernel.shapes, rows, local, strict=True):
        block = torch.zeros(r.numel(), shape.dim, device=r.device)
        if g is not None:
            block.index_add_(0, torch.searchsorted(r, g[0]), g[1])
        dense.append(block)
    flat = torch.cat([d.flatten() for d in dense])
    dist.all_reduce(flat, group=replicated.group)
    flat /= size
    count_all_reduce(counter, "replica_grad_sync", replicated.peers, flat.numel() * flat.element_size())
    blocks = torch.split(flat, [d.numel() for d in dense])
    return [(r, b.view(-1, shape.dim)) for r, b, shape in zip(rows, blocks, kernel.shapes, strict=True)]


@torch.no_grad()
def step_with_mean_gradients(replicated: Sequence[ReplicatedKernel], counter: ByteCounter | None = None,
                             across: ProcessGroup | None = None) -> None:
    """Step every kernel with its shards' gradients averaged over their copies; a collective that every
    rank of the world calls, also one holding no replicated shard.

    ``across``: the group joining the kernels' groups into the world (the mesh's shard group; the world
    where tables have their own group sizes), None
    when they span it. A mean with NaN or inf anywhere raises ``NonFiniteError`` on every rank, before
    any kernel is updated.
    """
    means = [reduce_sparse_gradients(r, counter) for r in replicated]
    averaged = [g.reshape(-1) for r, mean in zip(replicated, means, strict=True) if group_size(r.group) > 1
                for _, g in filter(None, mean) if g.numel()]
    finite = not averaged or bool(torch.isfinite(torch.stack([nonfinite_mark(g) for g in averaged]).sum()))
    if not agree_finite(finite, across):
        local = [r.name(k) for r in replicated if group_size(r.group) > 1
                 for k, grad in enumerate(r.kernel.sparse_gradients())
                 if grad is not None and not torch.isfinite(grad[1]).all()]
        raise_nonfinite("gradients about to be averaged over the copies (no row was updated)", local)
    for r, mean in zip(replicated, means, strict=True):
        r.kernel.step(mean)
