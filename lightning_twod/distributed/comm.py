"""Collectives of the sharded lookup, with explicit split sizes and byte accounting.

``all_to_all`` is differentiable: its backward runs the reverse all-to-all (send and receive
split sizes swapped) and multiplies the gradient by ``grad_scale``. Example with a group of two
ranks, flat tensors, ``send_splits`` per destination::

    rank 0: input [a0 a1 | b0]      send_splits [2, 1]   recv_splits [2, 3]   -> [a0 a1 | c0 c1 c2]
    rank 1: input [c0 c1 c2 | d0]   send_splits [3, 1]   recv_splits [1, 1]   -> [b0 | d0]

A group of one rank (or no process group at all) returns its input unchanged without calling
``torch.distributed``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.distributed.groups import group_size


class ByteCounter:
    """Bytes this rank sent to each peer (global rank), per collective name.

    Bytes a rank sends to itself never cross a link and are not counted.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.sent: dict[str, list[int]] = defaultdict(lambda: [0] * world_size)

    def add(self, name: str, peers: Sequence[int], nbytes: Sequence[int]) -> None:
        """Record ``nbytes[i]`` sent to global rank ``peers[i]`` by collective ``name``."""
        row = self.sent[name]
        for peer, count in zip(peers, nbytes, strict=True):
            if peer != self.rank:
                row[peer] += int(count)

    def merge(self, other: ByteCounter) -> None:
        """Add the bytes counted by ``other`` (e.g. a background thread's own counter)."""
        for name, row in other.sent.items():
            mine = self.sent[name]
            for peer, count in enumerate(row):
                mine[peer] += count

    def total(self, peers: Sequence[int] | None = None, names: Sequence[str] | None = None) -> int:
        """Bytes sent to ``peers`` (all when None) by the collectives ``names`` (all when None)."""
        chosen = self.sent.keys() if names is None else [n for n in names if n in self.sent]
        wanted = range(self.world_size) if peers is None else peers
        return sum(self.sent[name][peer] for name in chosen for peer in wanted)

    def by_name(self) -> dict[str, int]:
        return {name: sum(row) for name, row in self.sent.items()}

    def reset(self) -> None:
        self.sent.clear()


def _exchange(
    tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: ProcessGroup
) -> Tensor:
    out = tensor.new_empty(sum(recv_splits), *tensor.shape[1:])
    dist.all_to_all_single(
        out, tensor.contiguous(), output_split_sizes=list(recv_splits),
        input_split_sizes=list(send_splits), group=group,
    )
    return out


def _count(counter: ByteCounter | None, name: str, peers: Sequence[int] | None, tensor: Tensor,
           send_splits: Sequence[int]) -> None:
    if counter is not None and peers is not None:
        per_row = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 and len(tensor) else 1)
        counter.add(name, peers, [split * per_row for split in send_splits])


def exchange(
    tensor: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: ProcessGroup | None,
    counter: ByteCounter | None = None,
    name: str = "exchange",
    peers: Sequence[int] | None = None,
) -> Tensor:
    """Non-differentiable all-to-all along dim 0 (ids, lengths, headers).

    ``tensor`` [sum(send_splits), ...] -> [sum(recv_splits), ...]; ``peers`` are the global ranks
    of the group members, for byte accounting.
    """
    _count(counter, name, peers, tensor, send_splits)
    if group_size(group) == 1:
        return tensor
    return _exchange(tensor, send_splits, recv_splits, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, send_splits, recv_splits, group, grad_scale, comm_dtype, counter, name, peers):
        ctx.splits = (send_splits, recv_splits)
        ctx.group, ctx.grad_scale, ctx.comm_dtype = group, grad_scale, comm_dtype
        ctx.counter, ctx.name, ctx.peers = counter, name, peers
        wire = tensor if comm_dtype is None else tensor.to(comm_dtype)
        _count(counter, name, peers, wire, send_splits)
        out = wire if group_size(group) == 1 else _exchange(wire, send_splits, recv_splits, group)
        return out.to(tensor.dtype) if out is not tensor else out.clone()

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        wire = grad if ctx.comm_dtype is None else grad.to(ctx.comm_dtype)
        _count(ctx.counter, ctx.name + "_grad", ctx.peers, wire, recv_splits)
        if group_size(ctx.group) > 1:
            wire = _exchange(wire, recv_splits, send_splits, ctx.group)
        back = wire.to(grad.dtype)
        if ctx.grad_scale != 1.0:
            back = back * ctx.grad_scale
        return back, None, None, None, None, None, None, None, None


def all_to_all(
    tensor: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: ProcessGroup | None,
    *,
    grad_scale: float = 1.0,
    comm_dtype: torch.dtype | None = None,
    counter: ByteCounter | None = None,
    name: str = "all_to_all",
    peers: Sequence[int] | None = None,
) -> Tensor:
    """Differentiable all-to-all along dim 0: ``tensor`` [sum(send_splits), ...] -> [sum(recv_splits), ...].

    ``comm_dtype`` (e.g. ``torch.bfloat16``) is the type on the wire, forward and backward; the
    result keeps ``tensor``'s type. The backward multiplies the returned gradient by ``grad_scale``.
    """
    return _AllToAll.apply(
        tensor, list(send_splits), list(recv_splits), group, grad_scale, comm_dtype, counter, name, peers
    )
