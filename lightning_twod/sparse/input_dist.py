"""Input distribution: send each feature's ids to the ranks of the shard group that own them.

Every owner ``o`` of a shard group has a fixed list of *slots* ``(shard, feature)``, the same on
every rank (``core.shards.assign_slots``). Rank ``r`` (local batch ``B_r``) sends to each owner, in one all-to-all::

    [lengths of slot 0 (B_r) | lengths of slot 1 (B_r) | ... | ids of slot 0 | ids of slot 1 | ...]

after a small header all-to-all of ``(B_r, number of ids, has weights, rejected)`` per owner that
sizes it and carries each rank's input verdict: a batch that failed its check sends nothing, and
the whole shard group learns it there, with no collective of its own (``send_ids``; the checks are
``batch_error``, and ``reject`` raises the same error on every rank).
The owner reorders what it received from rank-major ``(rank, slot)`` to slot-major
``(slot, rank)`` so that its kernel sees, for each slot, the ``B_group = sum_r B_r`` bags of the
whole shard group, rank 0's first. Example, S = 2, owner 0 holds slots a and b::

    rank 0 sends [len a (B_0) | len b (B_0) | ids a | ids b]
    rank 1 sends [len a (B_1) | len b (B_1) | ids a | ids b]
    owner 0's kernel gets lengths [a: B_0 + B_1 bags | b: B_0 + B_1 bags], ids [a0 a1 b0 b1]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.shards import Slot
from lightning_twod.distributed.comm import ByteCounter, exchange
from lightning_twod.distributed.groups import MeshGroups, group_size
from lightning_twod.sparse.sharding import SCHEMES
from lightning_twod.sparse.sharding.base import Routed

if TYPE_CHECKING:
    from lightning_twod.sparse.sharded import ShardedCollection


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
            out.append(SCHEMES[slot.sharding_type].route(slot.shard, ids, lengths, weights))
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


# ----------------------------------------------------------------------------- checks
def weights_error(features: SparseFeatures, where: str) -> str | None:
    """Per-id weights that require grad: the ids' trip to their owners would drop that gradient."""
    if features.weights is None or not features.weights.requires_grad:
        return None
    return (f"{where}: the per-id weights of features {list(features.keys)} require grad, but the sharded "
            "lookup does not return a gradient for them; pass weights.detach() (or compute the weighting "
            "after the lookup)")


def batch_error(features: SparseFeatures, table_of: Mapping, validate: bool, where: str) -> str | None:
    """This rank's verdict on its batch: the message of its first problem, or None.

    ``table_of``: feature -> its ``EmbeddingTableConfig``; ``validate=False`` checks the weights only.
    """
    error = weights_error(features, where)
    if error or not validate:
        return error
    return features.validation_error(
        {f: t.num_embeddings for f, t in table_of.items()}, table_of={f: t.name for f, t in table_of.items()},
    )


def reject(error: str | None, world: ProcessGroup | None) -> NoReturn:
    """Raise the same ``ValueError`` on every rank: the messages of the ranks whose batch failed."""
    if group_size(world) == 1:
        raise ValueError(error)
    messages: list[str | None] = [None] * dist.get_world_size(world)
    dist.all_gather_object(messages, error, group=world)
    bad = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
    raise ValueError(f"invalid sparse input ({bad})")


# ----------------------------------------------------------------------------- one input dist
def send_ids(module: ShardedCollection, features: SparseFeatures, groups: MeshGroups,
             counter: ByteCounter | None = None, timer=None, error: str | None = None) -> DistributedIds:
    """Check this rank's batch, route its ids and send them to their owners in ``groups.shard``.

    Nothing is sent after the header all-to-all if any rank's batch is invalid: the verdicts travel
    in the headers, so in 1D (one shard group) the check needs no collective of its own. With
    several shard groups the other groups learn it from one all-reduce of a flag over
    ``groups.world``, launched before the routing and awaited after it, off the critical path.
    ``error``: a verdict given by the caller instead of the check (a batch it could not read).
    Raises nothing about the input: the caller raises on every rank when ``rejected``.
    """
    if timer is not None:
        timer.start("input_check")
    checks = module.checked_table_of is not None  # a sibling part: its twin checked the batch
    if error is None and checks:
        error = batch_error(features, module.checked_table_of, module.validate_inputs, module.where())
    world = groups.world
    pending = None
    if checks and module.validate_inputs and group_size(world) > group_size(groups.shard):
        flag = torch.tensor([0 if error is None else 1], device=features.device)
        pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world, async_op=True))
    if timer is not None:
        timer.stop("input_check")
        timer.start("input_dist")
    rejected, routed, headers, received = error is not None, None, None, None
    if rejected:  # nothing of a bad batch is routed: its ids may not even fit the tables
        nothing = torch.zeros(features.batch_size, dtype=torch.int64, device=features.device)
        empty = nothing[:0]
        routed = [[Routed(empty, nothing, None) for _ in owner] for owner in module.slots]
    elif not module.reads_features_as_they_are(features):
        routed = route(features, module.slots)
    if routed is not None:
        headers = exchange_headers(routed, features.batch_size, rejected, groups.shard)
        rejected = headers.rejected
    if pending is not None:
        pending[1].wait()
        rejected = bool(pending[0].item())
    if not rejected and routed is None:  # the batch as it is (see reads_features_as_they_are)
        received = ReceivedIds(features.values, features.lengths, features.weights, [features.batch_size], None)
    elif not rejected:
        received = distribute_ids(routed, features.batch_size, headers, len(module.slots[groups.shard_rank]),
                                  groups.shard, counter, groups.shard_ranks)
    if timer is not None:
        timer.stop("input_dist")
    return DistributedIds(routed, received, error, rejected)
