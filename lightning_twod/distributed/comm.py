"""Collectives of the sharded lookup, with explicit split sizes and byte accounting.

``PendingAllToAll`` (and ``all_to_all``, which waits at once) is differentiable and asynchronous:
launched when built, received by ``wait()``; its backward launches the reverse all-to-all (send
and receive split sizes swapped) and waits for it only at the end of the backward pass, then
multiplies the gradient by ``grad_scale``. Example with a group of two ranks, flat tensors,
``send_splits`` per destination::

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
from torch.autograd import Variable
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


def _count(counter: ByteCounter | None, name: str, peers: Sequence[int] | None, tensor: Tensor,
           send_splits: Sequence[int]) -> None:
    if counter is not None and peers is not None:
        per_row = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 and len(tensor) else 1)
        counter.add(name, peers, [split * per_row for split in send_splits])


def _launch(tensor: Tensor, send_splits: list[int], recv_splits: list[int],
            group: ProcessGroup | None) -> tuple[Tensor, dist.Work | None]:
    """Start ``tensor``'s all-to-all; ``(receive buffer, work to wait for)``. A group of one rank
    sends nothing: the buffer is ``tensor`` itself and there is no work."""
    if group_size(group) == 1:
        return tensor, None
    out = tensor.new_empty(sum(recv_splits), *tensor.shape[1:])
    work = dist.all_to_all_single(out, tensor, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                  group=group, async_op=True)
    return out, work


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
    out, work = _launch(tensor.contiguous(), list(send_splits), list(recv_splits), group)
    if work is not None:
        work.wait()
    return out


def _on_current_stream(tensor: Tensor) -> Tensor:
    """``tensor``, made on the stream of a launch, about to be read on the current one (the first read
    of a result, the end of a backward): on CUDA its memory is not reused before that stream is done."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return tensor


class PendingAllToAll:
    """A differentiable all-to-all along dim 0, launched when built and received by ``wait()``.

    Forward: ``tensor`` ``[sum(send_splits), ...]`` leaves at once (the collective runs in the
    background); ``wait()`` returns ``[sum(recv_splits), ...]`` in ``tensor``'s dtype, so whatever the
    caller does between the two (a dense layer that needs no embeddings) runs while the rows travel.
    ``comm_dtype`` (e.g. ``torch.bfloat16``) is the type on the wire, forward and backward;
    ``forward_dtype``, where given, the forward's instead (an fp16 table's rows: fp16, which holds them
    exactly), the gradients keeping ``comm_dtype``.

    Backward: when autograd reaches the result's node it launches the reverse all-to-all of the
    gradient and returns at once; the gradient is waited for at the end of the backward pass (an
    autograd engine callback), multiplied by ``grad_scale`` and handed to ``tensor``'s own graph (the
    lookup's backward and its fused row update). So the rest of the backward (the dense layers below
    the embeddings, DDP's bucket all-reduces) runs while the gradients travel. On CUDA,
    ``Work.wait()`` makes the current stream wait for the collective's stream, and the tensors on
    the wire are held here until then.

    ``timer`` (optional, ``start(name)``/``stop(name)``): the launch and the wait of the backward
    are charged to ``name + "_backward"``.
    """

    def __init__(
        self,
        tensor: Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: ProcessGroup | None,
        *,
        grad_scale: float = 1.0,
        comm_dtype: torch.dtype | None = None,
        forward_dtype: torch.dtype | None = None,
        counter: ByteCounter | None = None,
        name: str = "all_to_all",
        peers: Sequence[int] | None = None,
        timer=None,
    ) -> None:
        self.send_splits, self.recv_splits = list(send_splits), list(recv_splits)
        self.group, self.grad_scale, self.comm_dtype = group, grad_scale, comm_dtype
        self.counter, self.name, self.peers, self.timer = counter, name, peers, timer
        self.source: Tensor | None = tensor
        self.dtype = tensor.dtype
        wire_dtype = forward_dtype or comm_dtype
        self._wire = (tensor.detach() if wire_dtype is None else tensor.detach().to(wire_dtype)).contiguous()
        _count(counter, name, peers, self._wire, self.send_splits)
        self._received, self._work = _launch(self._wire, self.send_splits, self.recv_splits, group)
        self._waited = False

    def wait(self) -> Tensor:
        """The received rows ``[sum(recv_splits), ...]``; call it once.

        The result is not kept here: its autograd node holds this object, so keeping it would make
        a reference cycle that holds every step's rows and graph until Python's cycle collector runs.
        """
        if self._waited:
            raise RuntimeError(f"PendingAllToAll {self.name!r}: wait() was called already; keep its result")
        self._waited = True
        if self._work is not None:
            self._work.wait()
        received = _on_current_stream(self._received)
        if received.dtype != self.dtype:
            received = received.to(self.dtype)
        elif received is self._wire:  # nothing was sent: a fresh tensor, not an alias of the input
            received = received.clone()
        self._wire = self._work = None
        source = self.source
        if torch.is_grad_enabled() and source is not None and source.requires_grad:
            token = torch.empty(0, device=source.device, requires_grad=True)
            self._received = received
            result = _Arrive.apply(token, self)
        else:
            result, self.source = received, None
        self._received = None
        return result

    def _backward(self, grad: Tensor) -> None:
        """Launch the gradient's reverse all-to-all; queue the wait for the end of the backward pass."""
        if self.timer is not None:
            self.timer.start(self.name + "_backward")
        wire = (grad if self.comm_dtype is None else grad.to(self.comm_dtype)).contiguous()
        _count(self.counter, self.name + "_grad", self.peers, wire, self.recv_splits)
        received, work = _launch(wire, self.recv_splits, self.send_splits, self.group)
        if self.timer is not None:
            self.timer.stop(self.name + "_backward")
        dtype = grad.dtype  # the callback holds the wire tensors until the transfer is done, not ``grad``
        Variable._execution_engine.queue_callback(lambda: self._finish_backward(wire, received, work, dtype))

    def _finish_backward(self, wire: Tensor, received: Tensor, work: dist.Work | None, dtype: torch.dtype) -> None:
        """Wait for the gradient, scale it and run the source's backward. That graph is kept (as the
        outer one may be, ``retain_graph=True``) until this object goes with the result's graph."""
        if self.timer is not None:
            self.timer.start(self.name + "_backward")
        if work is not None:
            work.wait()
        back = _on_current_stream(received).to(dtype)
        if self.grad_scale != 1.0:
            back = back * self.grad_scale
        if self.timer is not None:
            self.timer.stop(self.name + "_backward")
        torch.autograd.backward(self.source, back, retain_graph=True)


class _Arrive(torch.autograd.Function):
    """The received rows of a ``PendingAllToAll`` as an autograd node: its backward launches the
    reverse all-to-all. Its only input is a fresh empty token, so autograd does not walk into the
    source's graph; ``PendingAllToAll._finish_backward`` does, once the gradient has arrived."""

    @staticmethod
    def forward(ctx, token, pending):
        ctx.pending = pending
        return pending._received

    @staticmethod
    def backward(ctx, grad):
        ctx.pending._backward(grad)
        return None, None


def all_to_all(tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
               group: ProcessGroup | None, **options) -> Tensor:
    """``PendingAllToAll(tensor, ...).wait()``: the differentiable all-to-all, received at once
    (its backward still overlaps with the rest of the backward pass). ``options``: those of
    ``PendingAllToAll``."""
    return PendingAllToAll(tensor, send_splits, recv_splits, group, **options).wait()
