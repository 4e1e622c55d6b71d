"""Output dist: the owners' lookup results go home, inside the shard group, and become each feature's output.

Pooled (``pooled_output_dist``): each owner's kernel returns ``[B_group, D_owner]`` rows in rank
order, so the ``B_r`` rows of rank ``r`` are one contiguous block; one all-to-all sends every block
home, and rank ``r`` assembles each feature's ``[B_r, D]`` with one strided copy per run of slots
(``PooledLayout``, ``AssemblePooled``): table-wise and data-parallel shards fill the feature,
column-wise shards their columns, row-wise partial sums are added (the sharding types' rule).
Unpooled (``sequence_output_dist``): one row per id goes home, and the sharding type puts each
feature's rows back in the original id order (``ShardingScheme.combine_sequence``).

On the wire (``comm_dtype``: fp32 by default): pooled rows are sums computed in fp32 and travel as
``comm_dtype`` says. The unpooled rows of fp16 tables travel as fp16 whatever it is
(``sequence_wire_dtype``): they are fp16 values read in fp32, so the wire is exact and half as long;
their gradients keep ``comm_dtype``. A collection's fp16 and fp32 tables are parts of their own
(``sharded.tables_by_part``), each with its own all-to-all: fp32 rows never share an fp16 message.

Gradients flow back through the reverse all-to-all to the owners, multiplied by ``grad_scale``;
it travels while the rest of the backward runs (``distributed.comm.PendingAllToAll``). The pooled
forward's all-to-all travels until the result is first read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.outputs import JaggedEmbeddings, PooledEmbeddings
from lightning_twod.distributed.comm import PendingAllToAll, all_to_all
from lightning_twod.sparse.input_dist import ReceivedIds, route
from lightning_twod.sparse.sharding import SCHEMES, scheme_of
from lightning_twod.sparse.sharding.base import Routed

if TYPE_CHECKING:
    from lightning_twod.sparse.sharded import ShardedCollection


def pooled_output_dist(module: ShardedCollection, features: SparseFeatures, layout: PooledLayout,
                       received: ReceivedIds, owned: Tensor | None, local: Tensor | None) -> PooledEmbeddings:
    """The owned kernel's ``[B_group, D_owner]`` (None: this rank owns nothing) and the data-parallel
    rows ``[B, d]`` -> this rank's ``PooledEmbeddings`` ``[B, sum D]`` in feature order.

    The all-to-all is launched here and waited for where the result is first read (its
    ``values()`` or a feature), so a model that runs its dense layers between the lookup and the
    interaction overlaps them with the transfer.
    """
    timer = module.timer
    batch = features.batch_size
    if timer is not None:
        timer.start("output_dist")
    groups = module.groups
    my_dim = layout.owner_dims[groups.shard_rank]
    if owned is None:  # every rank must join the backward all-to-all, so keep a grad path
        owned = torch.zeros(sum(received.batch_sizes), 0, device=features.device, requires_grad=True)
    pending = None
    if groups.dims.shard_group_size > 1 or module.grad_scale != 1.0 or module.comm_dtype is not None:
        pending = PendingAllToAll(
            owned.flatten(), [b * my_dim for b in received.batch_sizes], [batch * d for d in layout.owner_dims],
            groups.shard, grad_scale=module.grad_scale, comm_dtype=module.comm_dtype,
            counter=module.counter, name="output_dist", peers=groups.shard_ranks, timer=timer,
        )
    # the bag lengths as they are now: the batch may be edited in place before the result is read
    means = [(column, dim, features[feature].lengths.clone()) for feature, column, dim in layout.means]
    if timer is not None:
        timer.stop("output_dist")

    def arrive() -> Tensor:
        if timer is not None:
            timer.start("output_dist")
        # nothing to send, scale or round: the kernel's rows themselves, no copy
        back = owned.flatten() if pending is None else pending.wait()
        if layout.in_feature_order and not means:
            values = back.view(batch, layout.total_dim)  # one owner, already in feature order: no copy
        else:
            values = AssemblePooled.apply(back, local, batch, layout, means)
        if timer is not None:
            timer.stop("output_dist")
        return values

    return PooledEmbeddings(module.feature_names, layout.feature_dims, arrive, batch_size=batch)


def sequence_output_dist(module: ShardedCollection, features: SparseFeatures, routed: list[list[Routed]],
                         received: ReceivedIds, owned: list[Tensor] | None, local: list[Tensor] | None
                         ) -> dict[str, JaggedEmbeddings]:
    """The owned kernel's rows per slot ``[n_k, dim_k]`` and the data-parallel ones -> this rank's
    ``{feature: JaggedEmbeddings [N_f, D]}`` in the original id order."""
    my_slots = module.slots[module.groups.shard_rank]
    counts = received.slot_counts  # [S, my slots]: ids each rank sent to each of my slots
    send, send_splits = [], []
    if owned is not None:
        per_slot = [torch.split(rows, counts[:, k].tolist()) for k, rows in enumerate(owned)]
        for rank in range(len(received.batch_sizes)):
            parts = [per_slot[k][rank].flatten() for k in range(len(my_slots))]
            send.extend(parts)
            send_splits.append(sum(p.numel() for p in parts))
        flat = torch.cat(send)
    else:
        flat = torch.zeros(0, device=features.device, requires_grad=True)
        send_splits = [0] * len(received.batch_sizes)
    recv_splits = [sum(r.values.numel() * s.shard.dim for r, s in zip(per_owner, owner_slots, strict=True))
                   for per_owner, owner_slots in zip(routed, module.slots, strict=True)]
    back = all_to_all(
        flat, send_splits, recv_splits, module.groups.shard, grad_scale=module.grad_scale,
        comm_dtype=module.comm_dtype, forward_dtype=sequence_wire_dtype(module, received), counter=module.counter,
        name="output_dist", peers=module.groups.shard_ranks, timer=module.timer,
    )
    pieces: dict[str, list[tuple[Tensor, object]]] = {}
    for block, per_owner, owner_slots in zip(torch.split(back, recv_splits), routed, module.slots, strict=True):
        sizes = [r.values.numel() * s.shard.dim for r, s in zip(per_owner, owner_slots, strict=True)]
        for part, r, slot in zip(torch.split(block, sizes), per_owner, owner_slots, strict=True):
            pieces.setdefault(slot.feature, []).append((part.view(-1, slot.shard.dim), r))
    if local is not None:
        local_routed = route(features, [module.local_slots])[0]
        for rows, r, slot in zip(local, local_routed, module.local_slots, strict=True):
            pieces.setdefault(slot.feature, []).append((rows, r))

    out = {}
    for feature in module.feature_names:
        jagged = features[feature]
        parts = pieces[feature]
        scheme = scheme_of(module.plan[module.table_of[feature].name])
        values = scheme.combine_sequence([p for p, _ in parts], [r for _, r in parts], jagged.values.numel())
        out[feature] = JaggedEmbeddings(values, jagged.lengths)
    return out


def sequence_wire_dtype(module: ShardedCollection, received: ReceivedIds) -> torch.dtype | None:
    """The forward wire type of ``module``'s unpooled rows: fp16 for a part of fp16 tables looked up without
    per-id weights (its rows are fp16 values read in fp32: exact in fp16; weighted, they are products that
    are not), else None (``comm_dtype``'s). Every rank of the shard group decides alike: a part has one
    dtype, and ``received.weights`` is None on every rank of the group or on none (the ids' headers)."""
    return torch.float16 if module.weights_dtype == torch.float16 and received.weights is None else None


@dataclass(frozen=True)
class PooledLayout:
    """Where each slot's pooled columns go in the ``[B, sum of dims]`` output, in feature order.

    ``moves``: ``(source, source column, width, output column, add)`` per slot, in slot order (owners
    0..S-1, then data-parallel slots); ``source`` is the owner, or -1 for the data-parallel rows.
    Slots adjacent in both their source and the output are merged into one move.
    A slot lands at its feature's first column plus its shard's first column: table-wise and
    data-parallel shards fill the feature, column-wise shards their column range, and row-wise
    shards all fill the feature; where the sharding type's outputs are partial sums
    (``ShardingScheme.pooled_partial_sums``), every slot after a feature's first is added (``add``).
    """

    owner_dims: tuple[int, ...]
    local_dim: int
    total_dim: int
    feature_columns: tuple[int, ...]
    moves: tuple[tuple[int, int, int, int, bool], ...]
    feature_dims: tuple[int, ...] = ()
    means: tuple[tuple[str, int, int], ...] = ()  # (feature, first column, dim) of mean-pooled features

    @property
    def in_feature_order(self) -> bool:
        """One owner's block already holds every feature in order: the output needs no copy."""
        return self.moves == ((0, 0, self.total_dim, 0, False),)

    @classmethod
    def build(cls, slots, local_slots, feature_names, table_of) -> PooledLayout:
        feature_columns, column = {}, 0
        for feature in feature_names:
            feature_columns[feature] = column
            column += table_of[feature].embedding_dim
        slot_moves, summed = [], set()
        for source, source_slots in [*enumerate(slots), (-1, local_slots)]:
            offset = 0
            for slot in source_slots:
                start = feature_columns[slot.feature] + slot.shard.col_start
                add = SCHEMES[slot.sharding_type].pooled_partial_sums and slot.feature in summed
                slot_moves.append((source, offset, slot.shard.dim, start, add))
                summed.add(slot.feature)
                offset += slot.shard.dim
        covered = sorted({(start, start + width) for _, _, width, start, _ in slot_moves})
        if [c for span in covered for c in range(*span)] != list(range(column)):
            raise ValueError(f"the sharding plan does not cover every output column exactly: {covered}")
        moves: list[tuple[int, int, int, int, bool]] = []
        for move in slot_moves:
            last = moves[-1] if moves else None
            if (last is not None and not move[4] and not last[4] and last[0] == move[0]
                    and last[1] + last[2] == move[1] and last[3] + last[2] == move[3]):
                move = (move[0], last[1], last[2] + move[2], last[3], False)  # one copy for both
                moves.pop()
            moves.append(move)
        means = tuple((f, feature_columns[f], table_of[f].embedding_dim) for f in feature_names
                      if table_of[f].pooling == "mean")
        return cls(tuple(sum(s.shard.dim for s in owner) for owner in slots),
                   sum(s.shard.dim for s in local_slots), column,
                   tuple(feature_columns[f] for f in feature_names), tuple(moves),
                   tuple(table_of[f].embedding_dim for f in feature_names), means)


class AssemblePooled(torch.autograd.Function):
    """Owner blocks (the output all-to-all's ``[B * d_o]`` pieces) and data-parallel rows ``[B, d]``
    -> ``[B, sum of dims]`` in feature order; mean-pooled features divided by their bag lengths.

    One strided copy per slot each way: the per-slot views, concatenations and splits this
    replaces cost a full-size concatenation in backward for every owner block.
    """

    @staticmethod
    def forward(ctx, back, local, batch, layout, means):
        ctx.batch, ctx.layout, ctx.means = batch, layout, means
        ctx.shapes = (back.shape, None if local is None else local.shape)
        blocks = owner_blocks(back, batch, layout.owner_dims)
        out = back.new_empty(batch, layout.total_dim)
        for source, column, width, start, add in layout.moves:
            piece = (blocks[source] if source >= 0 else local)[:, column:column + width]
            if add:
                out[:, start:start + width].add_(piece)
            else:
                out[:, start:start + width].copy_(piece)
        for start, width, lengths in means:
            out[:, start:start + width].div_(lengths.clamp(min=1).unsqueeze(1).to(out.dtype))
        return out

    @staticmethod
    def backward(ctx, grad):
        layout, batch = ctx.layout, ctx.batch
        if ctx.means:
            grad = grad.clone()
            for start, width, lengths in ctx.means:
                grad[:, start:start + width].div_(lengths.clamp(min=1).unsqueeze(1).to(grad.dtype))
        back_shape, local_shape = ctx.shapes
        grad_back = grad.new_empty(back_shape) if ctx.needs_input_grad[0] else None
        grad_local = grad.new_empty(local_shape) if local_shape is not None and ctx.needs_input_grad[1] else None
        blocks = owner_blocks(grad_back, batch, layout.owner_dims) if grad_back is not None else None
        for source, column, width, start, _ in layout.moves:  # every source column is one slot's: all written
            target = blocks[source] if source >= 0 else grad_local
            if target is not None:
                target[:, column:column + width].copy_(grad[:, start:start + width])
        return grad_back, grad_local, None, None, None


def owner_blocks(flat: Tensor, batch: int, owner_dims) -> list[Tensor]:
    """Views ``[B, d_o]`` of the owner blocks of the output all-to-all's flat result."""
    blocks, start = [], 0
    for dim in owner_dims:
        blocks.append(flat[start:start + batch * dim].view(batch, dim))
        start += batch * dim
    return blocks
