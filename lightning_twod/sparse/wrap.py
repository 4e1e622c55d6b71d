"""Find the embedding modules of a user's model and swap in their sharded twins.

Collections (``EmbeddingBagCollection``, ``EmbeddingCollection``, and TorchRec's collections of the
same names, through ``torchrec_modules``) are swapped as they are. Plain
``torch.nn.EmbeddingBag`` and ``torch.nn.Embedding`` attributes are wrapped as one-table
collections named after their attribute path (``"user_emb"``, ``"tower.item_emb"``) and keep
their call signature; each then does its own all-to-all. A weight in fp16 makes an fp16 table
(``EmbeddingTableConfig(dtype="fp16")``: fp16 rows, fp32 optimizer state) whose twin returns fp16 as the
module did (looked up and pooled in fp32, then rounded); a weight in any other dtype but fp32 is refused.

A collection whose plan gives its tables several shard group sizes, or whose tables have sparse optimizer
settings of their own (``ShardingSpec.table_optimizer``), is split here (``split_twin``): every part is a
twin on the groups of one size with one sparse optimizer, and the twin the model sees holds the others as
its siblings (``ShardedCollection.parts()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.shards import ShardingType, TableSharding
from lightning_twod.distributed.consensus import raise_on_every_rank
from lightning_twod.sparse.modules import (
    DTYPES,
    EmbeddingBagCollection,
    EmbeddingCollection,
    EmbeddingTableConfig,
    TableCollection,
)
from lightning_twod.sparse.sharded import (
    ShardedCollection,
    ShardedEmbeddingBagCollection,
    ShardedEmbeddingCollection,
    ShardingSpec,
    complete_plan,
    tables_by_part,
)


def _plain_table(name: str, module: nn.Module, pooling: str) -> EmbeddingTableConfig:
    """The table of a plain ``nn.EmbeddingBag`` or ``nn.Embedding``, in its weight's dtype (fp32 or fp16)."""
    rows, dim = module.weight.shape
    dtypes = {dtype: key for key, dtype in DTYPES.items()}
    if module.weight.dtype not in dtypes:
        raise ValueError(
            f"{type(module).__name__} {name!r} has a {module.weight.dtype} weight; sharded tables keep fp32 or fp16 "
            f"rows: convert it (module.float() or module.half()) before training"
        )
    return EmbeddingTableConfig(name, rows, dim, [name], pooling=pooling, dtype=dtypes[module.weight.dtype])


def _one_table_collection(cls: type[TableCollection], table: EmbeddingTableConfig) -> TableCollection:
    """A meta-device collection of ``table`` alone, whose name may be a dotted attribute path.

    Module keys cannot contain ``"."``, so the collection's module is built under a plain key; the
    twin reads only the table configs (and gets its weights as ``source_weights``).
    """
    collection = cls([dataclasses.replace(table, name="table")], device="meta")
    collection.tables = [table]
    collection.table_of = {feature: table for feature in table.feature_names}
    return collection


class ShardedEmbeddingBag(ShardedEmbeddingBagCollection):
    """Sharded twin of a plain ``nn.EmbeddingBag`` (mode ``"sum"`` or ``"mean"``): same call.

    ``input`` [B, L] (fixed bags) or [N] with ``offsets`` [B] (or [B + 1] with
    ``include_last_offset``); ``per_sample_weights`` like ``input``. Returns ``[B, D]`` in the
    module's weight dtype.
    """

    def __init__(self, name: str, module: nn.EmbeddingBag, spec: ShardingSpec,
                 plan: Mapping[str, TableSharding] | None = None) -> None:
        if module.mode not in ("sum", "mean") or module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(
                f"nn.EmbeddingBag {name!r}: only mode='sum' or 'mean' without padding_idx or max_norm can be "
                f"sharded (got mode={module.mode!r}, padding_idx={module.padding_idx}, max_norm={module.max_norm}); "
                "drop those options or use an EmbeddingBagCollection"
            )
        collection = _one_table_collection(EmbeddingBagCollection, _plain_table(name, module, module.mode))
        # the collection is on meta: its weights are the module's
        super().__init__(collection, spec, plan, source_weights={"weight": module.weight.detach()}, path=name)
        self.name = name
        self.include_last_offset = module.include_last_offset
        self.output_dtype = module.weight.dtype

    def state_key(self, table: str) -> str:
        return "weight"

    def forward(self, input: Tensor, offsets: Tensor | None = None,  # noqa: A002 (nn.EmbeddingBag's name)
                per_sample_weights: Tensor | None = None) -> Tensor:
        if per_sample_weights is not None:  # an fp16 module's are fp16: the kernels pool in fp32
            per_sample_weights = per_sample_weights.float()
        if input.dim() == 2:
            batch, length = input.shape
            lengths = torch.full((batch,), length, dtype=torch.int64, device=input.device)
            values = input.flatten()
            weights = None if per_sample_weights is None else per_sample_weights.flatten()
        else:
            if offsets is None:
                raise ValueError(f"nn.EmbeddingBag {self.name!r}: a 1-D input needs offsets")
            ends = offsets[1:] if self.include_last_offset else torch.cat([offsets[1:], offsets.new_tensor([input.numel()])])
            starts = offsets[:-1] if self.include_last_offset else offsets
            lengths, values, weights = ends - starts, input, per_sample_weights
        features = SparseFeatures([self.name], values, lengths, weights)
        return super().forward(features).values().to(self.output_dtype)


class ShardedEmbedding(ShardedEmbeddingCollection):
    """Sharded twin of a plain ``nn.Embedding``: ids of any shape ``[*]`` -> ``[*, D]`` in the module's weight dtype."""

    def __init__(self, name: str, module: nn.Embedding, spec: ShardingSpec,
                 plan: Mapping[str, TableSharding] | None = None) -> None:
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(
                f"nn.Embedding {name!r}: padding_idx and max_norm cannot be sharded; drop them "
                "or use an EmbeddingCollection"
            )
        collection = _one_table_collection(EmbeddingCollection, _plain_table(name, module, "none"))
        # the collection is on meta: its weights are the module's
        super().__init__(collection, spec, plan, source_weights={"weight": module.weight.detach()}, path=name)
        self.name = name
        self.output_dtype = module.weight.dtype

    def state_key(self, table: str) -> str:
        return "weight"

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Embedding's name)
        ids = input.flatten()
        features = SparseFeatures([self.name], ids, torch.ones_like(ids))
        rows = super().forward(features)[self.name].values.to(self.output_dtype)
        return rows.view(*input.shape, rows.shape[-1])


Make = Callable[[ShardingSpec, dict[str, TableSharding], list[ShardedCollection]], ShardedCollection]


def split_twin(make: Make, tables: list[EmbeddingTableConfig], pooled: bool, spec: ShardingSpec,
               plan: Mapping[str, TableSharding] | None, source: Callable[[], Mapping[str, Tensor]],
               path: str = "") -> ShardedCollection:
    """The twin of a collection of ``tables`` split by shard group size, sparse optimizer and dtype
    (``tables_by_part``), each part on the groups of its size.

    ``make(spec, plan, siblings)`` builds the twin, for the part of its first sharded table (and the
    data-parallel tables trained as it is); before it, one sibling per other part: a collection of those tables alone
    on the meta device, whose weights come from ``source()`` (the unsharded ``state_dict``), and which
    checks no batch (the twin does). ``path``: the collection's attribute path in the model.
    """
    plan = complete_plan(tables, plan, spec.group_size)
    (own, _), *others = tables_by_part(tables, plan, spec).items()
    siblings = []
    if others:
        weights = source() if spec.init == "copy" else None
        first = None if weights is None else next(iter(weights.values()))
        device = spec.device or (first.device if first is not None and first.device.type != "meta" else "cpu")
        kind, collection = ((ShardedEmbeddingBagCollection, EmbeddingBagCollection) if pooled else
                            (ShardedEmbeddingCollection, EmbeddingCollection))
        for (size, optimizer, _dtype), part in others:
            part_spec = dataclasses.replace(spec.of_part(size, optimizer), device=device)
            sibling = kind(collection(part, device="meta"), part_spec,
                           {t.name: plan[t.name] for t in part}, weights, path=path)
            sibling.checked_table_of = None
            siblings.append(sibling)
    size, optimizer, _dtype = own
    return make(spec.of_part(size, optimizer), plan, siblings)


def shard_collection(module: TableCollection, spec: ShardingSpec, plan: Mapping[str, TableSharding] | None = None,
                     path: str = "") -> ShardedCollection:
    """The sharded twin of an ``EmbeddingBagCollection`` or ``EmbeddingCollection`` (``split_twin``)."""
    if isinstance(module, EmbeddingBagCollection):
        kind, pooled = ShardedEmbeddingBagCollection, True
    elif isinstance(module, EmbeddingCollection):
        kind, pooled = ShardedEmbeddingCollection, False
    else:
        raise TypeError(f"cannot shard {type(module).__name__}; expected an EmbeddingBagCollection or "
                        "EmbeddingCollection")
    return split_twin(lambda part_spec, part_plan, siblings: kind(module, part_spec, part_plan, siblings=siblings,
                                                                  path=path),
                      list(module.tables), pooled, spec, plan, module.state_dict, path)


def _spec_of_one(spec: ShardingSpec, table: str, plan: Mapping[str, TableSharding] | None) -> ShardingSpec:
    """``spec`` on the groups of the size ``plan`` gives ``table``, the one table of a plain module, with its
    own sparse optimizer if it has one."""
    sharding = (plan or {}).get(table)
    data_parallel = sharding is not None and sharding.sharding_type == ShardingType.DATA_PARALLEL
    size = spec.group_size if sharding is None or data_parallel else sharding.size_in(spec.group_size)
    return spec.of_part(size, spec.own_optimizer(table, data_parallel, size))


def is_torchrec_collection(module: nn.Module) -> bool:
    """Whether ``module`` is TorchRec's ``EmbeddingBagCollection`` or ``EmbeddingCollection`` (checked by
    its class, without importing torchrec)."""
    cls = type(module)
    return cls.__module__.startswith("torchrec.") and cls.__name__ in ("EmbeddingBagCollection", "EmbeddingCollection")


def find_embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(attribute path, module)`` of every embedding module to shard, outermost first.

    Modules inside a collection are part of it and not listed on their own.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        if isinstance(module, (TableCollection, nn.EmbeddingBag, nn.Embedding, ShardedCollection)) or \
                is_torchrec_collection(module):
            found.append((name, module))
    return found


def _tables_of(path: str, module: nn.Module) -> list[EmbeddingTableConfig]:
    if isinstance(module, ShardedCollection):
        return module.output_tables()
    if isinstance(module, TableCollection):
        return list(module.tables)
    if is_torchrec_collection(module):
        from lightning_twod.sparse.torchrec_modules import table_configs

        return table_configs(module)
    pooling = module.mode if isinstance(module, nn.EmbeddingBag) else "none"
    return [_plain_table(path, module, pooling)]


def embedding_tables(model: nn.Module) -> dict[str, list[EmbeddingTableConfig]]:
    """``{attribute path: [EmbeddingTableConfig]}`` of every module ``shard_model`` would swap."""
    return {path: _tables_of(path, module) for path, module in find_embedding_modules(model)}


def check_representable(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the attribute if a twin could not train an embedding module as it is.

    A twin keeps its rows outside the module tree and updates them with the sparse optimizer, so
    a table weight that is also another parameter (an output layer tied to it, or two modules
    sharing one) would silently split into two; ``scale_grad_by_freq`` is not applied by the kernels.
    """
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for path, module in find_embedding_modules(model):
        if isinstance(module, ShardedCollection):
            continue
        if getattr(module, "scale_grad_by_freq", False):
            raise ValueError(
                f"{type(module).__name__} {path!r} has scale_grad_by_freq=True, which the sharded kernels do "
                "not apply; set scale_grad_by_freq=False"
            )
        for name, param in module.named_parameters(remove_duplicate=False):
            own = f"{path}.{name}" if path else name
            tied = [other for other in owners[id(param)] if other != own]
            if tied:
                raise ValueError(
                    f"the embedding weight {own!r} is tied to {tied}: once sharded, the table's rows live in the "
                    "sharded twin and are updated by the sparse optimizer, so the tie would silently break; "
                    "untie them (give the other layer its own weight) or keep this table out of the strategy"
                )


def shard_model(model: nn.Module, spec: ShardingSpec) -> dict[str, ShardedCollection]:
    """Replace every embedding module of ``model`` in place by its sharded twin; a collective.

    ``spec`` says how (``spec.plans[path]``: the plan of the module at ``path``; default placement
    without one). Returns ``{path: twin}``. Already sharded modules are kept as they are. A failure
    on any rank raises on every rank, and the model is changed only when every rank built its twins;
    then every copy of a shard is set to its replica group's first member's (``broadcast_copies``),
    whatever each rank built.
    """
    twins: dict[str, ShardedCollection] = {}
    built: dict[str, ShardedCollection] = {}
    with raise_on_every_rank(spec.groups.world):
        check_representable(model)
        for path, module in find_embedding_modules(model):
            if isinstance(module, ShardedCollection):
                twins[path] = module
                continue
            if not path:
                raise ValueError("the model itself is an embedding module; wrap it in a LightningModule attribute")
            plan = spec.plans.get(path)
            if isinstance(module, TableCollection):
                twin = shard_collection(module, spec, plan, path)
            elif is_torchrec_collection(module):
                from lightning_twod.sparse.torchrec_modules import torchrec_twin

                twin = torchrec_twin(module, spec, plan, path)
            elif isinstance(module, nn.EmbeddingBag):
                twin = ShardedEmbeddingBag(path, module, _spec_of_one(spec, path, plan), plan)
            else:
                twin = ShardedEmbedding(path, module, _spec_of_one(spec, path, plan), plan)
            twins[path] = built[path] = twin
    for path, twin in built.items():
        _set_submodule(model, path, twin)
        twin.broadcast_copies()
    return twins


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, module)
