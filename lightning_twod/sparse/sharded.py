"""Sharded twins of the collections: input dist -> lookup -> output dist, inside a shard group.

A twin holds only this rank's shards (and full copies of data-parallel tables) and takes the same
``SparseFeatures`` (this rank's ``B`` samples) as the unsharded module. Pooled output dist: each
owner's kernel returns ``[B_group, D_owner]`` rows in rank order, so the ``B_r`` rows of rank
``r`` are one contiguous block; one all-to-all sends every block home, and rank ``r`` rebuilds
each feature's ``[B_r, D]`` (table-wise: take, column-wise: concatenate, row-wise: add).

Gradients flow back through the reverse all-to-all to the owners, multiplied by ``grad_scale``:
1 gives the gradient of the sum of the shard group's losses; ``1 / S`` the gradient of their mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.distributed.comm import ByteCounter, all_to_all, group_size
from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.kjt import as_features
from lightning_twod.sparse.input_dist import DistributedIds, ReceivedIds, Slot, distribute_ids, exchange_headers, route
from lightning_twod.sparse.kernels import FbgemmKernel, LookupKernel, ShardShape, make_kernel
from lightning_twod.sparse.modules import (
    EmbeddingBagCollection, EmbeddingCollection, EmbeddingTableConfig, _Collection,
)
from lightning_twod.core.outputs import JaggedEmbeddings, PooledEmbeddings
from lightning_twod.core.shards import ShardingType, TableSharding, place_tables
from lightning_twod.sparse.sharding import scheme_of
from lightning_twod.sparse.sharding.base import Routed
from lightning_twod.distributed import MeshGroups


class _ShardedCollection(nn.Module):
    """Plan, local kernels, input dist and input checks shared by the pooled and unpooled twins."""

    prefix = ""
    pooled = True

    def __init__(
        self,
        module: _Collection,
        groups: MeshGroups,
        plan: Mapping[str, TableSharding] | None = None,
        optimizer: SparseOptimizerConfig | None = None,
        data_parallel_optimizer: SparseOptimizerConfig | None = None,
        backend: str = "auto",
        grad_scale: float = 1.0,
        comm_dtype: torch.dtype | None = None,
        counter: ByteCounter | None = None,
        device: torch.device | str | None = None,
        init: str = "copy",
        source_weights: Mapping[str, Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.tables: list[EmbeddingTableConfig] = module.tables
        self.table_of = module.table_of
        self.feature_names = module.feature_names
        self.groups = groups
        self.grad_scale = grad_scale
        self.comm_dtype = comm_dtype
        self.counter = counter
        self.timer = None  # optional sparse.timing.PhaseTimer: per-phase wall times (benchmarks); None: off
        self.validate_inputs = True
        self.prefetched = None  # sparse.pipeline.Prefetched: ids of the next training lookup, sent ahead
        self.state_dict_tables = True  # False: state_dict() leaves the tables out (checkpoints save them sharded)
        # called before the tables are read: the strategy completes its replica reduction there (a collective)
        self.before_read: Callable[[], None] | None = None
        # called after load_state_dict wrote the tables: the strategy discards a round in flight there
        self.after_write: Callable[[], None] | None = None
        self.optimizer = optimizer or SparseOptimizerConfig()
        self.data_parallel_optimizer = data_parallel_optimizer or self.optimizer
        self.path = ""  # the attribute path in the user's model, for messages (``shard_model`` sets it)
        size = groups.dims.shard_group_size
        self.plan = dict(plan) if plan is not None else place_tables(
            [(t.name, t.num_embeddings, t.embedding_dim) for t in self.tables], size
        )
        missing = [t.name for t in self.tables if t.name not in self.plan]
        if missing:
            raise ValueError(f"the sharding plan has no entry for tables {missing}")

        self.slots: list[list[Slot]] = [[] for _ in range(size)]
        self.local_slots: list[Slot] = []
        for table in self.tables:
            sharding = self.plan[table.name]
            for shard in sharding.shards:
                for feature in table.feature_names:
                    slot = Slot(shard, feature, scheme_of(sharding))
                    if sharding.sharding_type == ShardingType.DATA_PARALLEL:
                        self.local_slots.append(slot)
                    else:
                        self.slots[shard.owner].append(slot)
        weight = next(module.parameters())
        device = device or (weight.device if weight.device.type != "meta" else "cpu")
        # A plain tuple keeps the kernels out of the module tree: their rows are owned and updated
        # by the sparse optimizer, so neither DDP nor the user's optimizer may see them.
        self._kernels = (
            self._make_kernel(self.slots[groups.shard_rank], backend, device, self.optimizer),
            self._make_kernel(self.local_slots, backend, device, self.data_parallel_optimizer),
        )
        if init == "copy":
            source = module.state_dict() if source_weights is None else source_weights
            if any(t.device.type == "meta" for t in source.values()):
                raise ValueError("the embedding tables are on the meta device; shard them with init='in_place'")
            self.load_unsharded(source)
        elif init == "in_place":
            self.initialize_in_place()
        else:
            raise ValueError(f"init={init!r}; use 'copy' (start from the module's weights) or 'in_place'")

    @property
    def kernel(self) -> LookupKernel | None:
        """The kernel of the shards this rank owns inside its shard group."""
        return self._kernels[0]

    @property
    def local_kernel(self) -> LookupKernel | None:
        """The kernel of the data-parallel tables (a full copy on every rank)."""
        return self._kernels[1]

    def _make_kernel(self, slots: list[Slot], backend: str, device, optimizer) -> LookupKernel | None:
        shards = list(dict.fromkeys(slot.shard for slot in slots))
        if not shards:
            return None
        return make_kernel(
            backend, [ShardShape(s.rows, s.dim) for s in shards], [shards.index(s.shard) for s in slots],
            self.pooled, optimizer, device,
        )

    # ----------------------------------------------------------------- weights
    def kernel_shards(self) -> list[tuple[LookupKernel, list]]:
        """``(kernel, its shards in kernel order)`` for the owned and the data-parallel kernel."""
        pairs = ((self.kernel, self.slots[self.groups.shard_rank]), (self.local_kernel, self.local_slots))
        return [(k, list(dict.fromkeys(slot.shard for slot in slots))) for k, slots in pairs if k is not None]

    def local_shards(self) -> list[tuple[object, Tensor]]:
        """``(shard, weight [rows, dim])`` for every shard this rank holds, data-parallel included."""
        return [pair for kernel, shards in self.kernel_shards() for pair in zip(shards, kernel.weights())]

    @torch.no_grad()
    def load_unsharded(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy this rank's slices out of full ``[num_embeddings, embedding_dim]`` tables."""
        for shard, weight in self.local_shards():
            full = state_dict[self.state_key(shard.table)]
            weight.copy_(full[shard.row_start:shard.row_end, shard.col_start:shard.col_end])

    def kernels(self) -> list[LookupKernel]:
        return [k for k in self._kernels if k is not None]

    @torch.no_grad()
    def initialize_in_place(self) -> None:
        """Initialize each local shard with its table's ``init``, without a full table anywhere.

        Local only: ``broadcast_copies`` then makes every copy equal.
        """
        for shard, weight in self.local_shards():
            self.table_config(shard.table).initialize(weight)

    @torch.no_grad()
    def broadcast_copies(self) -> None:
        """Make every copy of every shard bit-identical: the first member of each replica group
        sends its shards over the group (data-parallel tables: rank 0 over the world).

        A collective over the world. Processes that built their models with different random
        states (torchrun or popen without ``seed_everything``) then all start from one source.
        """
        for kernel, group, source in self.replication():
            if group_size(group) > 1:
                for weight in kernel.weights():
                    dist.broadcast(weight, src=source, group=group)

    def replication(self) -> list[tuple[LookupKernel, object, int]]:
        """``(kernel, group holding copies of its shards, global rank of the group's first member)``."""
        out = []
        if self.kernel is not None:
            out.append((self.kernel, self.groups.replica, self.groups.replica_ranks[0]))
        if self.local_kernel is not None:
            out.append((self.local_kernel, self.groups.world, 0))
        return out

    def describe_plan(self, title: str = "") -> str:
        """The plan as a table: one line per shard (table, type, owner, rows, columns)."""
        lines = [f"sharding plan {title}".rstrip(),
                 f"  {'table':<20} {'type':<14} {'owner':>5} {'rows':>21} {'cols':>11}"]
        for table in self.tables:
            sharding = self.plan[table.name]
            for shard in sharding.shards:
                owner = "all" if shard.owner < 0 else str(shard.owner)
                rows = f"[{shard.row_start}, {shard.row_end})"
                cols = f"[{shard.col_start}, {shard.col_end})"
                lines.append(f"  {table.name:<20} {sharding.sharding_type.value:<14} {owner:>5} {rows:>21} {cols:>11}")
        return "\n".join(lines)

    def table_config(self, name: str) -> EmbeddingTableConfig:
        return next(t for t in self.tables if t.name == name)

    def state_key(self, table: str) -> str:
        """The unsharded module's ``state_dict`` key of a table's weight."""
        return f"{self.prefix}.{table}.weight"

    @torch.no_grad()
    def full_table(self, name: str) -> Tensor:
        """The whole ``[num_embeddings, embedding_dim]`` table, assembled from replica 0's shards
        after ``before_read`` (the strategy's ``drain``: every replica then holds the same rows).

        A collective over the world: every rank must call it, and every rank gets the table.
        """
        if self.before_read is not None:
            self.before_read()
        table = self.table_config(name)
        device = self.kernels()[0].device() if self.kernels() else torch.device("cpu")
        full = torch.zeros(table.num_embeddings, table.embedding_dim, device=device)
        data_parallel = self.plan[name].sharding_type == ShardingType.DATA_PARALLEL
        contributes = self.groups.rank == 0 if data_parallel else self.groups.replica_rank == 0
        if contributes:
            for shard, weight in self.local_shards():
                if shard.table == name:
                    full[shard.row_start:shard.row_end, shard.col_start:shard.col_end] = weight
        if group_size(self.groups.world) > 1:
            dist.all_reduce(full, group=self.groups.world)
        return full

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Unsharded keys and shapes, so the state dict loads into the user's unsharded module.
        if not self.state_dict_tables:
            return
        for table in self.tables:
            destination[prefix + self.state_key(table.name)] = self.full_table(table.name)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if not self.state_dict_tables:
            return
        keys = {self.state_key(t.name): prefix + self.state_key(t.name) for t in self.tables}
        found = {k: state_dict[v] for k, v in keys.items() if v in state_dict}
        missing_keys.extend(v for k, v in keys.items() if k not in found)
        for shard, weight in self.local_shards():
            full = found.get(self.state_key(shard.table))
            if full is not None:
                weight.copy_(full[shard.row_start:shard.row_end, shard.col_start:shard.col_end])
        if found and self.after_write is not None:
            self.after_write()

    # ----------------------------------------------------------------- input
    def _input_error(self, features: SparseFeatures) -> str | None:
        """This rank's verdict on its batch: the message of its first problem, or None."""
        error = self._weights_error(features)
        if error or not self.validate_inputs:
            return error
        return features.validation_error(
            {f: t.num_embeddings for f, t in self.table_of.items()},
            table_of={f: t.name for f, t in self.table_of.items()},
        )

    def _weights_error(self, features: SparseFeatures) -> str | None:
        """Per-id weights that require grad: the ids' trip to their owners would drop that gradient."""
        if features.weights is None or not features.weights.requires_grad:
            return None
        where = f"{type(self).__name__} {self.path!r}" if self.path else type(self).__name__
        return (f"{where}: the per-id weights of features {list(features.keys)} require grad, but the sharded "
                "lookup does not return a gradient for them; pass weights.detach() (or compute the weighting "
                "after the lookup)")

    def _reject(self, error: str | None) -> None:
        """Raise the same ``ValueError`` on every rank: the messages of the ranks whose batch failed."""
        world = self.groups.world
        if group_size(world) == 1:
            raise ValueError(error)
        messages: list[str | None] = [None] * dist.get_world_size(world)
        dist.all_gather_object(messages, error, group=world)
        bad = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
        raise ValueError(f"invalid sparse input ({bad})")

    def _reads_features_as_they_are(self, features: SparseFeatures) -> bool:
        """Whether this rank's kernel can look up ``features`` without routing: a shard group of one
        rank whose slots are whole tables, one per feature of the batch, in the batch's order (then the
        key-major ids already are the kernel's slot-major input, and nothing is exchanged)."""
        if getattr(self, "_whole_slot_features", None) is None:
            slots = self.slots[0] if self.groups.dims.shard_group_size == 1 else []
            whole = all(s.shard.rows == self.table_config(s.shard.table).num_embeddings
                        and s.shard.dim == self.table_config(s.shard.table).embedding_dim for s in slots)
            self._whole_slot_features = [s.feature for s in slots] if slots and whole and self.pooled else []
        return bool(self._whole_slot_features) and features.keys == self._whole_slot_features

    def input_dist(self, features: SparseFeatures, groups: MeshGroups, counter: ByteCounter | None = None,
                   timer=None, error: str | None = None) -> DistributedIds:
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
        if error is None:
            error = self._input_error(features)
        world = groups.world
        pending = None
        if self.validate_inputs and group_size(world) > group_size(groups.shard):
            flag = torch.tensor([0 if error is None else 1], device=features.device)
            pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world, async_op=True))
        if timer is not None:
            timer.stop("input_check")
            timer.start("input_dist")
        rejected, routed, headers, received = error is not None, None, None, None
        if rejected:  # nothing of a bad batch is routed: its ids may not even fit the tables
            nothing = torch.zeros(features.batch_size, dtype=torch.int64, device=features.device)
            empty = nothing[:0]
            routed = [[Routed(empty, nothing, None) for _ in owner] for owner in self.slots]
        elif not self._reads_features_as_they_are(features):
            routed = route(features, self.slots)
        if routed is not None:
            headers = exchange_headers(routed, features.batch_size, rejected, groups.shard)
            rejected = headers.rejected
        if pending is not None:
            pending[1].wait()
            rejected = bool(pending[0].item())
        if not rejected and routed is None:  # the batch as it is (see _reads_features_as_they_are)
            received = ReceivedIds(features.values, features.lengths, features.weights, [features.batch_size], None)
        elif not rejected:
            received = distribute_ids(routed, features.batch_size, headers, len(self.slots[groups.shard_rank]),
                                      groups.shard, counter, groups.shard_ranks)
        if timer is not None:
            timer.stop("input_dist")
        return DistributedIds(routed, received, error, rejected)

    def _take_prefetched(self, features: SparseFeatures) -> DistributedIds | None:
        """The armed prefetch's ids if every rank's ``features`` are the batch it sent, else None
        (then every rank sends its ids now). One all-reduce of a flag over the world decides, so
        that every shard group takes the same path; the prefetch is spent either way."""
        prefetched, self.prefetched = self.prefetched, None
        timer = self.timer
        if timer is not None:
            timer.start("input_dist")
        same, ids = prefetched.take(features)
        same = same and self._weights_error(features) is None
        world = self.groups.world
        if group_size(world) > 1:
            flag = torch.tensor([int(same)], device=features.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=world)
            same = bool(flag.item())
        prefetched.outcome = "used" if same else "missed"
        if timer is not None:
            timer.stop("input_dist")
        return ids if same else None

    def lookup_owned(self, features: SparseFeatures):
        """Check, route and send ids, run the local kernels: what both output dists start from."""
        # The kernels are not submodules; Lightning restores train/eval mode by setting
        # ``training`` on submodules directly, so the mode is passed on here, at every lookup.
        for kernel in self.kernels():
            if kernel.training != self.training:
                kernel.train(self.training)
            if isinstance(kernel, FbgemmKernel) and kernel.inputs_checked != self.validate_inputs:
                kernel.inputs_checked = self.validate_inputs  # ids checked here: no second check in the kernel
        timer = self.timer
        ids = self._take_prefetched(features) if self.prefetched is not None and self.training else None
        if ids is None:
            ids = self.input_dist(features, self.groups, self.counter, timer)
        if ids.rejected:
            self._reject(ids.error)
        routed, received = ids.routed, ids.received
        if timer is not None:
            timer.start("lookup")
        if self.kernel is not None:
            owned = self.kernel(received.values, received.lengths, received.weights)
        else:
            owned = None
        local = None
        if self.local_kernel is not None:
            local_ids = route(features, [self.local_slots])[0]
            local = self.local_kernel(
                torch.cat([r.values for r in local_ids]), torch.cat([r.lengths for r in local_ids]),
                None if features.weights is None else torch.cat([r.weights for r in local_ids]),
            )
        if timer is not None:
            timer.stop("lookup")
            for out in (owned, local):
                if isinstance(out, Tensor):
                    timer.time_backward(out, "lookup_backward")
        return routed, received, owned, local


class ShardedEmbeddingBagCollection(_ShardedCollection):
    """Sharded twin of ``EmbeddingBagCollection``: ``SparseFeatures`` [B] -> ``PooledEmbeddings``."""

    prefix = "embedding_bags"
    pooled = True

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """This rank's ``features`` (or a TorchRec ``KeyedJaggedTensor``), B samples -> ``[B, sum D]``."""
        features = as_features(features, type(self).__name__)
        timer = self.timer
        batch = features.batch_size
        routed, received, owned, local = self.lookup_owned(features)
        if timer is not None:
            timer.start("output_dist")
        size = self.groups.dims.shard_group_size
        layout = self._pooled_layout()
        my_dim = layout.owner_dims[self.groups.shard_rank]
        if owned is None:  # every rank must join the backward all-to-all, so keep a grad path
            owned = torch.zeros(sum(received.batch_sizes), 0, device=features.device, requires_grad=True)
        if size == 1 and self.grad_scale == 1.0 and self.comm_dtype is None:
            back = owned.flatten()  # nothing to send, scale or round: skip the all-to-all's copy
        else:
            back = all_to_all(
                owned.flatten(), [b * my_dim for b in received.batch_sizes], [batch * d for d in layout.owner_dims],
                self.groups.shard, grad_scale=self.grad_scale, comm_dtype=self.comm_dtype,
                counter=self.counter, name="output_dist", peers=self.groups.shard_ranks,
            )
        means = [(column, dim, features[feature].lengths) for feature, column, dim in layout.means]
        if layout.in_feature_order and not means:
            values = back.view(batch, layout.total_dim)  # one owner, already in feature order: no copy
        else:
            values = _AssemblePooled.apply(back, local, batch, layout, means)
        if timer is not None:
            timer.stop("output_dist")
            timer.time_backward(back, "output_dist_backward", max_nodes=1)  # the all-to-all alone
        return PooledEmbeddings(self.feature_names, layout.feature_dims, values)

    def _pooled_layout(self) -> _PooledLayout:
        if getattr(self, "_layout", None) is None:
            self._layout = _PooledLayout.build(self.slots, self.local_slots, self.feature_names, self.table_of)
        return self._layout


@dataclass(frozen=True)
class _PooledLayout:
    """Where each slot's pooled columns go in the ``[B, sum of dims]`` output, in feature order.

    ``moves``: ``(source, source column, width, output column, add)`` per slot, in slot order (owners
    0..S-1, then data-parallel slots); ``source`` is the owner, or -1 for the data-parallel rows.
    Slots adjacent in both their source and the output are merged into one move.
    A slot lands at its feature's first column plus its shard's first column: table-wise and
    data-parallel shards fill the feature, column-wise shards their column range, and row-wise
    shards all fill the feature and are added (``add``: a slot before it wrote those columns).
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
    def build(cls, slots, local_slots, feature_names, table_of) -> _PooledLayout:
        feature_columns, column = {}, 0
        for feature in feature_names:
            feature_columns[feature] = column
            column += table_of[feature].embedding_dim
        slot_moves, written = [], set()
        for source, source_slots in [*enumerate(slots), (-1, local_slots)]:
            offset = 0
            for slot in source_slots:
                start = feature_columns[slot.feature] + slot.shard.col_start
                key = (start, slot.shard.dim)
                slot_moves.append((source, offset, slot.shard.dim, start, key in written))
                written.add(key)
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


class _AssemblePooled(torch.autograd.Function):
    """Owner blocks (the output all-to-all's ``[B * d_o]`` pieces) and data-parallel rows ``[B, d]``
    -> ``[B, sum of dims]`` in feature order; mean-pooled features divided by their bag lengths.

    One strided copy per slot each way: the per-slot views, concatenations and splits this
    replaces cost a full-size concatenation in backward for every owner block.
    """

    @staticmethod
    def forward(ctx, back, local, batch, layout, means):
        ctx.batch, ctx.layout, ctx.means = batch, layout, means
        ctx.shapes = (back.shape, None if local is None else local.shape)
        blocks = _owner_blocks(back, batch, layout.owner_dims)
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
        blocks = _owner_blocks(grad_back, batch, layout.owner_dims) if grad_back is not None else None
        for source, column, width, start, _ in layout.moves:  # every source column is one slot's: all written
            target = blocks[source] if source >= 0 else grad_local
            if target is not None:
                target[:, column:column + width].copy_(grad[:, start:start + width])
        return grad_back, grad_local, None, None, None


def _owner_blocks(flat: Tensor, batch: int, owner_dims) -> list[Tensor]:
    """Views ``[B, d_o]`` of the owner blocks of the output all-to-all's flat result."""
    blocks, start = [], 0
    for dim in owner_dims:
        blocks.append(flat[start:start + batch * dim].view(batch, dim))
        start += batch * dim
    return blocks


class ShardedEmbeddingCollection(_ShardedCollection):
    """Sharded twin of ``EmbeddingCollection``: one vector per id, returned in the original id order."""

    prefix = "embeddings"
    pooled = False

    def forward(self, features: SparseFeatures) -> dict[str, JaggedEmbeddings]:
        """This rank's ``features`` (or a TorchRec ``KeyedJaggedTensor``) -> ``{feature: [N_f, D]}``."""
        features = as_features(features, type(self).__name__)
        routed, received, owned, local = self.lookup_owned(features)
        my_slots = self.slots[self.groups.shard_rank]
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
                       for per_owner, owner_slots in zip(routed, self.slots, strict=True)]
        back = all_to_all(
            flat, send_splits, recv_splits, self.groups.shard, grad_scale=self.grad_scale,
            comm_dtype=self.comm_dtype, counter=self.counter, name="output_dist", peers=self.groups.shard_ranks,
        )
        pieces: dict[str, list[tuple[Tensor, object]]] = {}
        for block, per_owner, owner_slots in zip(torch.split(back, recv_splits), routed, self.slots, strict=True):
            sizes = [r.values.numel() * s.shard.dim for r, s in zip(per_owner, owner_slots, strict=True)]
            for part, r, slot in zip(torch.split(block, sizes), per_owner, owner_slots, strict=True):
                pieces.setdefault(slot.feature, []).append((part.view(-1, slot.shard.dim), r))
        if local is not None:
            local_routed = route(features, [self.local_slots])[0]
            for rows, r, slot in zip(local, local_routed, self.local_slots, strict=True):
                pieces.setdefault(slot.feature, []).append((rows, r))

        out = {}
        for feature in self.feature_names:
            jagged = features[feature]
            parts = pieces[feature]
            scheme = scheme_of(self.plan[self.table_of[feature].name])
            values = scheme.combine_sequence([p for p, _ in parts], [r for _, r in parts], jagged.values.numel())
            out[feature] = JaggedEmbeddings(values, jagged.lengths)
        return out


def shard_collection(module: _Collection, groups: MeshGroups, **kwargs) -> _ShardedCollection:
    """The sharded twin of an ``EmbeddingBagCollection`` or ``EmbeddingCollection``."""
    if isinstance(module, EmbeddingBagCollection):
        return ShardedEmbeddingBagCollection(module, groups, **kwargs)
    if isinstance(module, EmbeddingCollection):
        return ShardedEmbeddingCollection(module, groups, **kwargs)
    raise TypeError(f"cannot shard {type(module).__name__}; expected an EmbeddingBagCollection or EmbeddingCollection")
