"""Input distribution: send each feature's ids to the ranks of the shard group that own them.

Every owner ``o`` of a shard group has a fixed list of *slots* ``(shard, feature)``, the same on
every rank. Rank ``r`` (local batch ``B_r``) sends to each owner, in one all-to-all::

    [lengths of slot 0 (B_r) | lengths of slot 1 (B_r) | ... | ids of slot 0 | ids of slot 1 | ...]

after a small header all-to-all of ``(B_r, number of ids, has weights, rejected)`` per owner that
sizes it and carries each rank's input verdict: a batch that failed its check sends nothing, and
the whole shard group learns it there, with no collective of its own.
The owner reorders what it received from rank-major ``(rank, slot)`` to slot-major
``(slot, rank)`` so that its kernel sees, for each slot, the ``B_group = sum_r B_r`` bags of the
whole shard group, rank 0's first. Example, S = 2, owner 0 holds slots a and b::

    rank 0 sends [len a (B_0) | len b (B_0) | ids a | ids b]
    rank 1 sends [len a (B_1) | len b (B_1) | ids a | ids b]
    owner 0's kernel gets lengths [a: B_0 + B_1 bags | b: B_0 + B_1 bags], ids [a0 a1 b0 b1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.distributed.comm import ByteCounter, exchange
from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.shards import Shard
from lightning_twod.sparse.sharding.base import Routed, ShardingScheme


@dataclass(frozen=True)
class Slot:
    """One feature reading one shard; ``scheme`` is the table's sharding type."""

    shard: Shard
    feature: str
    scheme: ShardingScheme


def exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def transpose_segments(values: Tensor, seg_lengths: Tensor) -> Tensor:
    """Reorder segments stored row-major ``(r, c)`` into column-major ``(c, r)`` order.

    ``values`` [sum(seg_lengths)]; ``seg_lengths`` [R, C] lengths of the segments.
    """
    starts = exclusive_cumsum(seg_lengths.flatten()).view_as(seg_lengths)
    lengths_t, starts_t = seg_lengths.t().flatten(), starts.t().flatten()
    shift = starts_t - exclusive_cumsum(lengths_t)
    index = torch.repeat_interleave(shift, lengths_t) + torch.arange(values.numel(), device=values.device)
    return values[index]


@dataclass
class ReceivedIds:
    """What an owner's kernel looks up for its whole shard group.

    ``values`` [N], ``lengths`` [num_slots * B_group] slot-major, ``weights`` [N] | None;
    ``batch_sizes`` [S]: local batch of each rank; ``slot_counts`` [S, num_slots]: ids per (rank, slot)
    (None where nothing was exchanged: a pooled lookup of the batch as it is).
    """

    values: Tensor
    lengths: Tensor
    weights: Tensor | None
    batch_sizes: list[int]
    slot_counts: Tensor | None


def route(features: SparseFeatures, slots: Sequence[Sequence[Slot]]) -> list[list[Routed]]:
    """Per owner, per slot: the ids of the slot's feature that the slot's shard must look up."""
    jagged = {}
    routed = []
    for owner_slots in slots:
        out = []
        for slot in owner_slots:
            if slot.feature not in jagged:
                jagged[slot.feature] = features[slot.feature]
            ids, lengths, weights = jagged[slot.feature]
            out.append(slot.scheme.route(slot.shard, ids, lengths, weights))
        routed.append(out)
    return routed


@dataclass
class Headers:
    """What every rank of the shard group announced to this owner before sending ids.

    ``batch_sizes`` and ``num_ids``: ``B_r`` and the number of ids rank ``r`` sends here;
    ``any_weights``: some rank sends per-id weights; ``rejected``: some rank's batch failed its
    input check (it then sends nothing, and nobody looks anything up).
    """

    batch_sizes: list[int]
    num_ids: list[int]
    any_weights: bool
    rejected: bool


@dataclass
class DistributedIds:
    """The outcome of one input dist, on one rank.

    ``routed``: per owner, per slot, the ids this rank sent (None: its kernel reads the batch as it
    is, nothing was exchanged); ``received``: what this rank's slots look up (None when rejected);
    ``error``: this rank's verdict on its batch; ``rejected``: some rank's batch failed its check,
    and every rank then raises (nothing was sent after the headers).
    """

    routed: list[list[Routed]] | None
    received: ReceivedIds | None
    error: str | None
    rejected: bool


HEADER = 4  # int64 per owner: batch size, ids, has weights, rejected


def exchange_headers(routed: list[list[Routed]], batch_size: int, rejected: bool,
                     group: ProcessGroup | None) -> Headers:
    """The header all-to-all that sizes the ids exchange and carries every rank's input verdict."""
    device = next((r.values.device for per_owner in routed for r in per_owner), None)
    has_weights = any(r.weights is not None for per_owner in routed for r in per_owner)
    header = torch.tensor(
        [[batch_size, sum(r.values.numel() for r in per_owner), int(has_weights), int(rejected)]
         for per_owner in routed], dtype=torch.int64, device=device,
    ).flatten()
    got = exchange(header, [HEADER] * len(routed), [HEADER] * len(routed), group).view(len(routed), HEADER)
    batch_sizes, num_ids, any_weights, rejections = got.t().tolist()
    return Headers(batch_sizes, num_ids, any(any_weights), any(rejections))


def distribute_ids(
    routed: list[list[Routed]],
    batch_size: int,
    headers: Headers,
    my_num_slots: int,
    group: ProcessGroup | None,
    counter: ByteCounter | None = None,
    peers: Sequence[int] | None = None,
) -> ReceivedIds:
    """Send ``routed[o]`` to owner ``o``; return what this rank's own slots receive.

    ``routed`` has one list per rank of the shard group (``S`` lists), ``batch_size`` this rank's
    ``B``, ``headers`` what the header exchange returned; ``my_num_slots`` the slots this rank owns.
    """
    if counter is not None and peers is not None:  # the header, counted once the ids go too
        counter.add("input_dist", peers, [HEADER * 8] * len(peers))
    device = next((r.values.device for per_owner in routed for r in per_owner), None)
    batch_sizes, num_ids = headers.batch_sizes, headers.num_ids
    payload = []
    for per_owner in routed:
        payload.extend(r.lengths for r in per_owner)
        payload.extend(r.values for r in per_owner)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    send = torch.cat(payload) if payload else empty
    send_splits = [len(per_owner) * batch_size + sum(r.values.numel() for r in per_owner) for per_owner in routed]
    recv_splits = [my_num_slots * b + n for b, n in zip(batch_sizes, num_ids, strict=True)]
    recv = exchange(send, send_splits, recv_splits, group, counter, "input_dist", peers)

    lengths, values = [], []
    for chunk, b in zip(torch.split(recv, recv_splits), batch_sizes, strict=True):
        lengths.append(chunk[: my_num_slots * b].view(my_num_slots, b))
        values.append(chunk[my_num_slots * b:])
    slot_counts = torch.stack([lens.sum(dim=1) for lens in lengths]) if lengths else empty.view(0, 0)
    kernel_lengths = torch.cat(lengths, dim=1).flatten() if lengths else empty
    if len(values) == 1:  # one rank: already slot-major
        kernel_values = values[0]
    else:
        kernel_values = transpose_segments(torch.cat(values), slot_counts) if values else empty

    kernel_weights = None
    if headers.any_weights:
        wts = [r.weights if r.weights is not None else torch.ones_like(r.values, dtype=torch.float32)
               for per_owner in routed for r in per_owner]
        send_w = torch.cat(wts).float() if wts else torch.zeros(0, device=device)
        recv_w = exchange(send_w, [sum(r.values.numel() for r in o) for o in routed], num_ids, group,
                          counter, "input_dist", peers)
        kernel_weights = recv_w if len(values) == 1 else transpose_segments(recv_w, slot_counts)
    return ReceivedIds(kernel_values, kernel_lengths, kernel_weights, batch_sizes, slot_counts)
