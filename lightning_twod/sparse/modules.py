"""Unsharded embedding collections: what a user writes in a model.

They run on one process with no distributed set-up. The strategy later swaps each of them for a
sharded twin with the same inputs, outputs and ``state_dict`` keys::

    ebc = EmbeddingBagCollection([
        EmbeddingTableConfig("user", 1000, 16, ["user_id"]),
        EmbeddingTableConfig("item", 5000, 16, ["item_id", "last_item_id"]),   # shared table
    ])
    ebc.state_dict().keys()  # embedding_bags.user.weight [1000, 16], embedding_bags.item.weight [5000, 16]
    out = ebc(features)      # PooledEmbeddings: out["item_id"] is [B, 16]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.kjt import as_features
from lightning_twod.core.outputs import JaggedEmbeddings, PooledEmbeddings

POOLINGS = ("sum", "mean", "none")
INITS = ("uniform", "normal", "zeros")
#: ``EmbeddingTableConfig.dtype`` -> the dtype a table's rows are stored in.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass
class EmbeddingTableConfig:
    """One embedding table and the features that look it up."""

    name: str
    """Table name; the state_dict key is ``embedding_bags.<name>.weight`` (``embeddings.`` unpooled)."""
    num_embeddings: int
    """Rows: ids of every feature of this table must lie in ``[0, num_embeddings)``."""
    embedding_dim: int
    """Columns: the length of each embedding vector."""
    feature_names: list[str] = field(default_factory=list)
    """Features that share this table; defaults to ``[name]``."""
    pooling: str = "sum"
    """How the ids of one sample are combined: ``"sum"``, ``"mean"`` (weighted sum / number of ids)
    or ``"none"`` (one vector per id; only in ``EmbeddingCollection``)."""
    init: str | Callable[[Tensor], None] = "uniform"
    """``"uniform"``: U(-1/sqrt(rows), 1/sqrt(rows)) as TorchRec; ``"normal"``: N(0, 1/sqrt(dim));
    ``"zeros"``; or a function filling a ``[rows, dim]`` tensor in place."""
    dtype: str = "fp32"
    """How the rows are stored: ``"fp32"`` or ``"fp16"`` (half the memory; lookups still return fp32 and
    the optimizer state stays fp32: each update is computed in fp32 from the row's fp32 value and written
    back rounded, ``sparse.optimizers.sparse_update``)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EmbeddingTableConfig needs a non-empty name")
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"table {self.name!r}: {attr} must be a positive int, got {value!r}")
        self.feature_names = list(self.feature_names) or [self.name]
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table {self.name!r}: feature_names repeat: {self.feature_names}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling={self.pooling!r}; use one of {POOLINGS}")
        if isinstance(self.init, str) and self.init not in INITS:
            raise ValueError(f"table {self.name!r}: init={self.init!r}; use one of {INITS} or a function")
        if self.dtype not in DTYPES:
            raise ValueError(f"table {self.name!r}: dtype={self.dtype!r}; use one of {tuple(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the table's rows (``DTYPES[dtype]``)."""
        return DTYPES[self.dtype]

    def initialize(self, weight: Tensor) -> None:
        """Fill ``weight`` ([num_embeddings, embedding_dim], or any row slice of it) in place; an fp16
        ``weight`` gets the fp32 values rounded to nearest (the same draws as an fp32 table)."""
        if weight.dtype != torch.float32:
            full = torch.empty(weight.shape, device=weight.device)
            self.initialize(full)
            with torch.no_grad():
                weight.copy_(full)
            return
        with torch.no_grad():
            if callable(self.init):
                self.init(weight)
            elif self.init == "uniform":
                bound = math.sqrt(1.0 / self.num_embeddings)
                weight.uniform_(-bound, bound)
            elif self.init == "normal":
                weight.normal_(0.0, math.sqrt(1.0 / self.embedding_dim))
            else:
                weight.zero_()


def pooled_lookup(
    weight: Tensor, ids: Tensor, lengths: Tensor, weights: Tensor | None, pooling: str
) -> Tensor:
    """Pool rows of ``weight`` [R, D] per bag: ``ids`` [N], ``lengths`` [B] -> ``[B, D]`` fp32.

    ``"mean"`` divides the (weighted) sum by the number of ids; an empty bag gives zeros. The rows of an
    fp16 ``weight`` are read in fp32 and summed in fp32 (``rows_fp32``).
    """
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    if weight.dtype != torch.float32:
        weight, ids = rows_fp32(weight, ids), torch.arange(ids.numel(), device=ids.device)
    pooled = F.embedding_bag(
        ids, weight, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True
    )
    if pooling == "mean":
        pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
    return pooled


def rows_fp32(weight: Tensor, ids: Tensor) -> Tensor:
    """The rows ``ids`` [N] of ``weight`` [R, D] in fp32: ``[N, D]`` (an fp16 row widens exactly)."""
    return F.embedding(ids, weight).float()


class TableCollection(nn.Module):
    """Shared bookkeeping of the two collections: tables, feature order and input checks."""

    def __init__(self, tables: Sequence[EmbeddingTableConfig]) -> None:
        super().__init__()
        if not tables:
            raise ValueError(f"{type(self).__name__} needs at least one EmbeddingTableConfig")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names repeat: {names}")
        self.tables = list(tables)
        self.table_of: dict[str, EmbeddingTableConfig] = {}
        for table in tables:
            for feature in table.feature_names:
                if feature in self.table_of:
                    raise ValueError(
                        f"feature {feature!r} is listed by tables {self.table_of[feature].name!r} and "
                        f"{table.name!r}; a feature reads exactly one table"
                    )
                self.table_of[feature] = table
        self.feature_names = [f for t in tables for f in t.feature_names]
        self.validate_inputs = True

    @property
    def device(self) -> torch.device:
        """The device of the tables (TorchRec's ``EmbeddingBagCollection.device``); it follows ``.to()``."""
        return next(self.parameters()).device

    def check(self, features: SparseFeatures) -> None:
        """Raise ``ValueError`` naming the feature and table for any invalid id, length or key."""
        if self.validate_inputs:
            features.validate(
                {f: t.num_embeddings for f, t in self.table_of.items()},
                table_of={f: t.name for f, t in self.table_of.items()},
            )

    def inputs(self, features: SparseFeatures) -> SparseFeatures:
        """``features`` (or a TorchRec ``KeyedJaggedTensor``), checked; with the tables on the meta
        device, moved there (the result has shapes only, as TorchRec's collections give)."""
        features = as_features(features, type(self).__name__)
        self.check(features)
        if self.device.type != "meta":
            return features
        features.length_per_key()  # real ids' counts travel with the copy (on meta they are a guess)
        return features.to(self.device)


class EmbeddingBagCollection(TableCollection):
    """Pooled lookups of several tables: ``SparseFeatures`` -> ``PooledEmbeddings`` ``[B, sum D]``."""

    def __init__(self, tables: Sequence[EmbeddingTableConfig], device: torch.device | str | None = None):
        super().__init__(tables)
        for table in self.tables:
            if table.pooling == "none":
                raise ValueError(
                    f"table {table.name!r} has pooling='none'; put unpooled tables in an "
                    "EmbeddingCollection, or choose pooling='sum' or 'mean'"
                )
        self.embedding_bags = nn.ModuleDict()
        for table in self.tables:
            bag = nn.EmbeddingBag(table.num_embeddings, table.embedding_dim, mode="sum", device=device,
                                  dtype=table.torch_dtype)
            table.initialize(bag.weight)
            self.embedding_bags[table.name] = bag

    @property
    def feature_dims(self) -> list[int]:
        return [self.table_of[f].embedding_dim for f in self.feature_names]

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """``features`` (or a TorchRec ``KeyedJaggedTensor``) with B samples -> per-feature ``[B, D_f]``
        in ``feature_names`` order."""
        features = self.inputs(features)
        pooled = []
        for feature in self.feature_names:
            table = self.table_of[feature]
            jagged = features[feature]
            weight = self.embedding_bags[table.name].weight
            pooled.append(pooled_lookup(weight, jagged.values, jagged.lengths, jagged.weights, table.pooling))
        return PooledEmbeddings(self.feature_names, self.feature_dims, torch.cat(pooled, dim=1))


class EmbeddingCollection(TableCollection):
    """Unpooled (sequence) lookups: ``SparseFeatures`` -> ``{feature: JaggedEmbeddings [N_f, D]}`` (fp32).

    Per-id weights, when given, scale each id's vector.
    """

    def __init__(self, tables: Sequence[EmbeddingTableConfig], device: torch.device | str | None = None):
        super().__init__(tables)
        for table in self.tables:
            if table.pooling != "none":
                raise ValueError(
                    f"table {table.name!r} has pooling={table.pooling!r}; an EmbeddingCollection returns "
                    "one vector per id: set pooling='none', or use an EmbeddingBagCollection"
                )
        self.embeddings = nn.ModuleDict()
        for table in self.tables:
            emb = nn.Embedding(table.num_embeddings, table.embedding_dim, device=device, dtype=table.torch_dtype)
            table.initialize(emb.weight)
            self.embeddings[table.name] = emb

    def forward(self, features: SparseFeatures) -> dict[str, JaggedEmbeddings]:
        """``features`` (or a TorchRec ``KeyedJaggedTensor``) -> ``{feature: [N_f, D]}``."""
        features = self.inputs(features)
        out = {}
        for feature in self.feature_names:
            jagged = features[feature]
            rows = rows_fp32(self.embeddings[self.table_of[feature].name].weight, jagged.values)
            if jagged.weights is not None:
                rows = rows * jagged.weights.unsqueeze(1).to(rows.dtype)
            out[feature] = JaggedEmbeddings(rows, jagged.lengths)
        return out
