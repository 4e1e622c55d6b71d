"""Sharded twins of the collections: input dist -> lookup -> output dist, inside a shard group.

A twin holds only this rank's shards (and full copies of data-parallel tables) and takes the same
``SparseFeatures`` (this rank's ``B`` samples) as the unsharded module. ``ShardedCollection`` holds
the plan, the slots (``core.shards.assign_slots``), the local kernels and the weights (copies,
broadcasts, the unsharded ``state_dict``), and runs one lookup: ``input_dist.send_ids`` (checks and
ids to their owners, or the ids the pipeline sent ahead), the kernels, then ``output_dist`` (pooled
rows or one row per id back home). Gradients flow back through the reverse all-to-all to the owners,
multiplied by ``grad_scale``: 1 gives the gradient of the sum of the shard group's losses; ``1 / S``
the gradient of their mean.

Tables of one collection may have their own shard group sizes (``TableSharding.group_size``): the
twin then runs one part per distinct size, each a ``ShardedCollection`` over the groups of that size
alone, with its own optimizer scale and gradient scale (``parts()``: the twin first, for the size of
its first sharded table and the data-parallel tables, then one sibling per other size; the factory,
``wrap.shard_collection``, splits the collection and builds them). Every part
sends its ids and launches its output all-to-all in turn, so a part's transfer travels while the
next part looks up; the result is one ``PooledEmbeddings`` (or ``{feature: JaggedEmbeddings}``) in
the collection's feature order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.kjt import as_features
from lightning_twod.core.outputs import JaggedEmbeddings, PooledEmbeddings
from lightning_twod.core.shards import ShardingType, Slot, TableSharding, assign_slots, place_tables
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.distributed.groups import MeshGroups, group_size
from lightning_twod.sparse.input_dist import DistributedIds, reject, route, send_ids, weights_error
from lightning_twod.sparse.kernels import FbgemmKernel, LookupKernel, ShardShape, make_kernel
from lightning_twod.sparse.modules import (
    EmbeddingTableConfig,
    TableCollection,
)
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.output_dist import PooledLayout, pooled_output_dist, sequence_output_dist


@dataclass(frozen=True)
class GroupLayout:
    """The process groups of one shard group size, and how the tables sharded over them train."""

    groups: MeshGroups
    optimizer: SparseOptimizerConfig = SparseOptimizerConfig()
    grad_scale: float = 1.0


@dataclass(frozen=True)
class ShardingSpec:
    """How every sharded twin of a model is built: ``shard_model`` passes it down to each.

    ``groups``, ``optimizer``, ``grad_scale``: the mesh of the default shard group size and how its
    tables train; ``other_sizes``: the same for each other size some table's plan gives
    (``TableSharding.group_size``); ``data_parallel_optimizer``: that of the data-parallel tables
    (default: ``optimizer``). ``plans``: ``{attribute path: {table: TableSharding}}`` (a path not in
    it: ``place_tables``' default). ``init``: ``"copy"`` (from the module's weights) or
    ``"in_place"``. ``before_read`` is called before the tables are read (the strategy completes its
    replica reduction there, a collective), ``after_write`` after ``load_state_dict`` wrote them
    (the strategy discards a round in flight there). ``table_optimizer(table, data_parallel, size)``:
    the config of a table trained with settings of its own (sharded over groups of ``size``, or
    data-parallel), None for a table trained as the spec says; such tables go to parts of their own
    (``tables_by_part``).
    """

    groups: MeshGroups
    optimizer: SparseOptimizerConfig = SparseOptimizerConfig()
    data_parallel_optimizer: SparseOptimizerConfig | None = None
    grad_scale: float = 1.0
    other_sizes: Mapping[int, GroupLayout] = field(default_factory=dict)
    plans: Mapping[str, Mapping[str, TableSharding]] = field(default_factory=dict)
    backend: str = "auto"
    comm_dtype: torch.dtype | None = None
    counter: ByteCounter | None = None
    device: torch.device | str | None = None
    init: str = "copy"
    validate_inputs: bool = True
    before_read: Callable[[], None] | None = None
    after_write: Callable[[], None] | None = None
    table_optimizer: Callable[[str, bool, int], SparseOptimizerConfig | None] | None = None

    @property
    def group_size(self) -> int:
        """The default shard group size: that of ``groups``."""
        return self.groups.dims.shard_group_size

    def of_size(self, size: int) -> ShardingSpec:
        """This spec on the groups of ``size`` ranks, with their optimizer and gradient scale."""
        if size == self.group_size:
            return self
        if size not in self.other_sizes:
            raise ValueError(f"the plan gives tables shard groups of {size} ranks; the spec has groups of "
                             f"{sorted({self.group_size, *self.other_sizes})} only (ShardingSpec.other_sizes)")
        layout = self.other_sizes[size]
        return replace(self, groups=layout.groups, optimizer=layout.optimizer, grad_scale=layout.grad_scale)

    def of_part(self, size: int, optimizer: SparseOptimizerConfig | None) -> ShardingSpec:
        """This spec on the groups of ``size`` ranks for tables trained by ``optimizer`` (None: the size's own)."""
        spec = self.of_size(size)
        return spec if optimizer is None else replace(spec, optimizer=optimizer, data_parallel_optimizer=optimizer)

    def own_optimizer(self, table: str, data_parallel: bool, size: int) -> SparseOptimizerConfig | None:
        """``table_optimizer``'s config of ``table``, None for a table trained as the spec says."""
        return None if self.table_optimizer is None else self.table_optimizer(table, data_parallel, size)


class ShardedCollection(nn.Module):
    """Plan, local kernels, input dist and input checks shared by the pooled and unpooled twins.

    ``module``: the collection (its tables; its weights unless ``source_weights``, the unsharded
    ``state_dict`` to copy from with ``init="copy"``); ``spec``: how to shard it, on the groups of
    its one shard group size; ``plan``: ``{table: TableSharding}`` (default: ``place_tables``);
    ``siblings``: the parts holding the collection's tables of other shard group sizes, each on its
    own groups (``wrap.shard_collection`` builds them and this twin: ``parts()``); ``path``: the
    collection's attribute path in the user's model, for messages.
    """

    prefix = ""
    pooled = True

    def __init__(
        self,
        module: TableCollection,
        spec: ShardingSpec,
        plan: Mapping[str, TableSharding] | None = None,
        source_weights: Mapping[str, Tensor] | None = None,
        siblings: Sequence[ShardedCollection] = (),
        path: str = "",
    ) -> None:
        super().__init__()
        #: the parts over groups of the other sizes (not submodules: the twin saves and loads their tables)
        self.siblings: tuple[ShardedCollection, ...] = tuple(siblings)
        elsewhere = {t.name for sibling in self.siblings for t in sibling.tables}
        own = [t for t in module.tables if t.name not in elsewhere]
        size = spec.group_size
        plan = complete_plan(own, plan, size)
        other = sorted({t.name for t in own if plan[t.name].sharding_type != ShardingType.DATA_PARALLEL
                        and plan[t.name].size_in(size) != size})
        if other:
            raise ValueError(f"the plan gives tables {other} other shard group sizes than these groups' {size}; "
                             "shard the collection with shard_collection or shard_model, which split it by size")
        if spec.init == "copy" and source_weights is None:
            source_weights = module.state_dict()
        weight = next(module.parameters())
        device = spec.device or (weight.device if weight.device.type != "meta" else "cpu")
        groups = spec.groups
        #: the collection's features in its order: the order of the result, whatever part reads them
        self.output_features = list(module.feature_names)
        #: what the batch is checked against (every table of the collection); None: a sibling (the twin checks)
        self.checked_table_of = dict(module.table_of)
        self.tables: list[EmbeddingTableConfig] = own
        self.table_of = {feature: t for t in own for feature in t.feature_names}
        self.feature_names = [feature for t in own for feature in t.feature_names]
        self.spec = spec
        self.groups = groups
        self.grad_scale = spec.grad_scale
        self.comm_dtype = spec.comm_dtype
        self.counter = spec.counter
        self.timer = None  # optional sparse.timing.PhaseTimer: per-phase wall times (benchmarks); None: off
        self.validate_inputs = spec.validate_inputs
        self.prefetched = None  # sparse.pipeline.Prefetched: ids of the next training lookup, sent ahead
        self.state_dict_tables = True  # False: state_dict() leaves the tables out (checkpoints save them sharded)
        self.before_read = spec.before_read
        self.after_write = spec.after_write
        self.optimizer = spec.optimizer
        self.data_parallel_optimizer = spec.data_parallel_optimizer or self.optimizer
        self.path = path
        self.plan = {t.name: plan[t.name] for t in own}

        # the slots of each owner position of the shard group, in its kernel's order; the data-parallel ones
        self.slots, self.local_slots = assign_slots([(t.name, t.feature_names) for t in self.tables], self.plan, size)
        self.whole_slot_features = self._whole_slot_features()
        # A plain tuple keeps the kernels out of the module tree: their rows are owned and updated
        # by the sparse optimizer, so neither DDP nor the user's optimizer may see them.
        # A shard with a single copy is in no reduction round: its kernel checks its gradients itself.
        self._kernels = (
            self._make_kernel(self.slots[groups.shard_rank], spec.backend, device, self.optimizer,
                              single_copy=groups.dims.num_replicas == 1),
            self._make_kernel(self.local_slots, spec.backend, device, self.data_parallel_optimizer,
                              single_copy=groups.dims.world_size == 1),
        )
        if spec.init == "copy":
            if any(t.device.type == "meta" for t in source_weights.values()):
                raise ValueError("the embedding tables are on the meta device; shard them with init='in_place'")
            self.load_unsharded(source_weights)
        elif spec.init == "in_place":
            self.initialize_in_place()
        else:
            raise ValueError(f"init={spec.init!r}; use 'copy' (start from the module's weights) or 'in_place'")

    def parts(self) -> tuple[ShardedCollection, ...]:
        """This twin and its siblings: one part per shard group size of its tables."""
        return (self, *self.siblings)

    def part_of(self, table: str) -> ShardedCollection:
        """The part that holds ``table``."""
        return next(part for part in self.parts() if table in part.plan)

    @property
    def kernel(self) -> LookupKernel | None:
        """The kernel of the shards this rank owns inside its shard group."""
        return self._kernels[0]

    @property
    def local_kernel(self) -> LookupKernel | None:
        """The kernel of the data-parallel tables (a full copy on every rank)."""
        return self._kernels[1]

    def _make_kernel(self, slots: list[Slot], backend: str, device, optimizer, single_copy: bool) -> LookupKernel | None:
        shards = list(dict.fromkeys(slot.shard for slot in slots))
        if not shards:
            return None
        return make_kernel(
            backend, [ShardShape(s.rows, s.dim) for s in shards], [shards.index(s.shard) for s in slots],
            self.pooled, optimizer, device, single_copy=single_copy, dtype=self.weights_dtype,
        )

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype of this part's rows: that of its tables (``tables_by_part`` gives a part one)."""
        return self.tables[0].torch_dtype if self.tables else torch.float32

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
        for kernel, group, source in (r for part in self.parts() for r in part.replication()):
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
        """The plan as a table: one line per shard (table, with its dtype where not fp32, type, shard group
        size, owner, rows, columns)."""
        lines = [f"sharding plan {title}".rstrip(),
                 f"  {'table':<20} {'type':<14} {'group':>5} {'owner':>5} {'rows':>21} {'cols':>11}"]
        for table in self.output_tables():
            part = self.part_of(table.name)
            sharding = part.plan[table.name]
            group = "world" if sharding.sharding_type == ShardingType.DATA_PARALLEL else part.groups.dims.shard_group_size
            for shard in sharding.shards:
                owner = "all" if shard.owner < 0 else str(shard.owner)
                rows = f"[{shard.row_start}, {shard.row_end})"
                cols = f"[{shard.col_start}, {shard.col_end})"
                name = table.name if table.dtype == "fp32" else f"{table.name} ({table.dtype})"
                lines.append(f"  {name:<20} {sharding.sharding_type.value:<14} {group:>5} {owner:>5} "
                             f"{rows:>21} {cols:>11}")
        return "\n".join(lines)

    def output_tables(self) -> list[EmbeddingTableConfig]:
        """Every table of the collection (all parts), in the collection's order."""
        tables = {t.name: t for part in self.parts() for t in part.tables}
        order = list(dict.fromkeys(self.checked_table_of[f].name for f in self.output_features))
        return [tables[name] for name in order]

    def table_config(self, name: str) -> EmbeddingTableConfig:
        return next(t for t in self.tables if t.name == name)

    def state_key(self, table: str) -> str:
        """The unsharded module's ``state_dict`` key of a table's weight."""
        return f"{self.prefix}.{table}.weight"

    @torch.no_grad()
    def full_table(self, name: str) -> Tensor:
        """The whole ``[num_embeddings, embedding_dim]`` table in its dtype, assembled from replica 0's shards
        after ``before_read`` (the strategy's ``drain``: every replica then holds the same rows).

        A collective over the world: every rank must call it, and every rank gets the table.
        """
        if name not in self.plan:
            return self.part_of(name).full_table(name)
        if self.before_read is not None:
            self.before_read()
        table = self.table_config(name)
        device = self.kernels()[0].device() if self.kernels() else torch.device("cpu")
        full = torch.zeros(table.num_embeddings, table.embedding_dim, device=device, dtype=table.torch_dtype)
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
        for table in self.output_tables():
            destination[prefix + self.state_key(table.name)] = self.full_table(table.name)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if not self.state_dict_tables:
            return
        keys = {self.state_key(t.name): prefix + self.state_key(t.name) for t in self.output_tables()}
        found = {k: state_dict[v] for k, v in keys.items() if v in state_dict}
        missing_keys.extend(v for k, v in keys.items() if k not in found)
        for shard, weight in (pair for part in self.parts() for pair in part.local_shards()):
            full = found.get(self.state_key(shard.table))
            if full is not None:
                weight.copy_(full[shard.row_start:shard.row_end, shard.col_start:shard.col_end])
        if found and self.after_write is not None:
            self.after_write()

    # ----------------------------------------------------------------- input
    def where(self) -> str:
        """This twin in messages: its class and the attribute path in the user's model."""
        return f"{type(self).__name__} {self.path!r}" if self.path else type(self).__name__

    def _whole_slot_features(self) -> list[str]:
        """The features of a shard group of one rank whose slots are whole tables (pooled), in slot
        order; else nothing (see ``reads_features_as_they_are``)."""
        slots = self.slots[0] if self.groups.dims.shard_group_size == 1 else []
        whole = all(s.shard.rows == self.table_config(s.shard.table).num_embeddings
                    and s.shard.dim == self.table_config(s.shard.table).embedding_dim for s in slots)
        return [s.feature for s in slots] if slots and whole and self.pooled else []

    def reads_features_as_they_are(self, features: SparseFeatures) -> bool:
        """Whether this rank's kernel can look up ``features`` without routing: a shard group of one
        rank whose slots are whole tables, one per feature of the batch, in the batch's order (then the
        key-major ids already are the kernel's slot-major input, and nothing is exchanged)."""
        return bool(self.whole_slot_features) and features.keys == self.whole_slot_features

    def input_dist(self, features: SparseFeatures, groups: MeshGroups, counter: ByteCounter | None = None,
                   timer=None, error: str | None = None) -> DistributedIds:
        """This rank's batch checked and its ids sent to their owners in ``groups.shard`` (``send_ids``)."""
        return send_ids(self, features, groups, counter, timer, error)

    def _take_prefetched(self, features: SparseFeatures) -> DistributedIds | None:
        """The armed prefetch's ids if every rank's ``features`` are the batch it sent, else None
        (then every rank sends its ids now). One all-reduce of a flag over the world decides, so
        that every shard group takes the same path; the prefetch is spent either way."""
        prefetched, self.prefetched = self.prefetched, None
        timer = self.timer
        if timer is not None:
            timer.start("input_dist")
        same, ids = prefetched.take(features)
        same = same and weights_error(features, self.where()) is None
        world = self.groups.world
        if group_size(world) > 1:
            flag = torch.tensor([int(same)], device=features.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=world)
            same = bool(flag.item())
        prefetched.outcome = "used" if same else "missed"
        if timer is not None:
            timer.stop("input_dist")
        return ids if same else None

    def lookup_in(self, twin: ShardedCollection, features: SparseFeatures):
        """This sibling's lookup of its features of ``features`` (checked by ``twin``), in ``twin``'s mode,
        with its checks (its kernels skip their own where the twin checked the ids) and its timer."""
        self.training, self.validate_inputs, self.timer = twin.training, twin.validate_inputs, twin.timer
        return self.forward(features)

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
            reject(ids.error, self.groups.world)
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


class ShardedEmbeddingBagCollection(ShardedCollection):
    """Sharded twin of ``EmbeddingBagCollection``: ``SparseFeatures`` [B] -> ``PooledEmbeddings``."""

    prefix = "embedding_bags"
    pooled = True

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """This rank's ``features`` (or a TorchRec ``KeyedJaggedTensor``), B samples -> ``[B, sum D]``."""
        features = as_features(features, type(self).__name__)
        _, received, owned, local = self.lookup_owned(features)
        pooled = pooled_output_dist(self, features, self.pooled_layout(), received, owned, local)
        if not self.siblings:
            return pooled
        return merge_pooled([pooled, *(sibling.lookup_in(self, features) for sibling in self.siblings)],
                            self.output_features)

    def pooled_layout(self) -> PooledLayout:
        """Where each slot's pooled columns go in the output (built once)."""
        if getattr(self, "_layout", None) is None:
            self._layout = PooledLayout.build(self.slots, self.local_slots, self.feature_names, self.table_of)
        return self._layout


class ShardedEmbeddingCollection(ShardedCollection):
    """Sharded twin of ``EmbeddingCollection``: one vector per id, returned in the original id order."""

    prefix = "embeddings"
    pooled = False

    def forward(self, features: SparseFeatures) -> dict[str, JaggedEmbeddings]:
        """This rank's ``features`` (or a TorchRec ``KeyedJaggedTensor``) -> ``{feature: [N_f, D]}``."""
        features = as_features(features, type(self).__name__)
        routed, received, owned, local = self.lookup_owned(features)
        rows = sequence_output_dist(self, features, routed, received, owned, local)
        for sibling in self.siblings:
            rows.update(sibling.lookup_in(self, features))
        return {feature: rows[feature] for feature in self.output_features} if self.siblings else rows


def all_parts(twins: Mapping[str, ShardedCollection]) -> list[tuple[str, ShardedCollection]]:
    """``(path, part)`` of every part of every twin (one per shard group size of its tables)."""
    return [(path, part) for path, twin in twins.items() for part in twin.parts()]


def complete_plan(tables: Sequence[EmbeddingTableConfig], plan: Mapping[str, TableSharding] | None,
                  size: int) -> dict[str, TableSharding]:
    """``plan`` of ``tables`` (default: ``place_tables`` over groups of ``size``); raises ``ValueError``
    naming the tables it has no entry for."""
    if plan is None:
        return place_tables([(t.name, t.num_embeddings, t.embedding_dim) for t in tables], size)
    missing = [t.name for t in tables if t.name not in plan]
    if missing:
        raise ValueError(f"the sharding plan has no entry for tables {missing}")
    return dict(plan)


def tables_by_part(tables: list[EmbeddingTableConfig], plan: Mapping[str, TableSharding], spec: ShardingSpec
                   ) -> dict[tuple[int, SparseOptimizerConfig | None, str], list[EmbeddingTableConfig]]:
    """``{(shard group size, optimizer of their own or None, dtype): tables}`` in the collection's order, the
    part of the first sharded table first; data-parallel tables take that table's size (their copies are on
    every rank, whatever the size). Tables trained with settings of their own (``spec.own_optimizer``) or
    stored in another dtype (``EmbeddingTableConfig.dtype``) go to parts of their own: each kernel keeps one
    optimizer config and one weights dtype."""
    default = spec.group_size
    sharded = [t for t in tables if plan[t.name].sharding_type != ShardingType.DATA_PARALLEL]
    first = plan[sharded[0].name].size_in(default) if sharded else default

    def key(table: EmbeddingTableConfig) -> tuple[int, SparseOptimizerConfig | None, str]:
        data_parallel = plan[table.name].sharding_type == ShardingType.DATA_PARALLEL
        size = first if data_parallel else plan[table.name].size_in(default)
        return size, spec.own_optimizer(table.name, data_parallel, size), table.dtype

    by_part: dict[tuple[int, SparseOptimizerConfig | None, str], list[EmbeddingTableConfig]] = \
        {key(sharded[0]): []} if sharded else {}
    for table in tables:
        by_part.setdefault(key(table), []).append(table)
    return by_part or {(default, None, "fp32"): []}


def merge_pooled(parts: list[PooledEmbeddings], features: list[str]) -> PooledEmbeddings:
    """The parts' pooled rows as one ``[B, sum D]`` result in the order of ``features``; the parts'
    all-to-alls are waited for where it is first read."""
    where = {feature: part for part in parts for feature in part.keys()}
    dims = [where[f].dims[where[f].keys().index(f)] for f in features]
    in_order = [f for part in parts for f in part.keys()] == features

    def arrive() -> Tensor:
        if in_order:
            return torch.cat([part.values() for part in parts], dim=1)
        return torch.cat([where[f][f] for f in features], dim=1)

    return PooledEmbeddings(features, dims, arrive, batch_size=parts[0].batch_size)
