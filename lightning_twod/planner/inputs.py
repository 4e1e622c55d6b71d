"""What the planner is given: the tables (``TableSpec``), how they are trained (``Workload``), and
the byte sizes of what they store and send.

Row access is modelled as ``id = floor(rows * u ** id_skew)`` with ``u ~ U(0, 1)`` (the synthetic
data's generator): ``id_skew = 1`` is uniform access (hashed ids), larger is a power law
concentrated on low ids. The estimators that read these are ``traffic`` (bytes sent),
``reduction`` (the cross-group reduction), ``storage`` (bytes held) and ``load`` (seconds per
shard, what the partitioner balances).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

FP32_BYTES = 4  # bytes: weights, optimizer state, pooled outputs, per-id weights (torch.float32)
#: Bytes an element of a table's rows, by ``EmbeddingTableConfig.dtype`` (its optimizer state is fp32 either way).
ROW_BYTES = {"fp32": FP32_BYTES, "fp16": 2}
INDEX_BYTES = 8  # bytes: ids and bag lengths travel as int64 (sparse/input_dist.py)
GIB = float(1 << 30)  # bytes
#: Bytes per element of the weights reduction's payload, by ``sync_dtype`` (``replication/wire.py``).
SYNC_BYTES = {"fp32": FP32_BYTES, "bf16": 2, "int8": 1}


@dataclass(frozen=True)
class TableSpec:
    """One table as the planner sees it: its shape and how it is looked up."""

    name: str
    rows: int
    dim: int
    features: int = 1  # features reading this table (a shared table has several)
    pooling_factor: float = 1.0  # mean ids per sample, per feature
    pooled: bool = True  # EmbeddingBagCollection (True) or EmbeddingCollection (False)
    weighted: bool = False  # the batch carries per-id weights
    id_skew: float = 1.0  # popularity: id = floor(rows * u ** id_skew); 1 = uniform
    hashed: bool = False  # popular rows scattered over the table (hashed ids), not the lowest ids
    row_bytes: int = FP32_BYTES  # bytes an element of its rows: 2 for an fp16 table (ROW_BYTES)

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1 or self.features < 1:
            raise ValueError(f"table {self.name!r}: rows, dim and features must be >= 1, got "
                             f"{self.rows}, {self.dim}, {self.features}")
        if self.row_bytes not in ROW_BYTES.values():
            raise ValueError(f"table {self.name!r}: row_bytes={self.row_bytes!r}; use one of "
                             f"{sorted(set(ROW_BYTES.values()))} (fp16 or fp32 rows)")
        if self.pooling_factor < 0 or self.id_skew <= 0:
            raise ValueError(f"table {self.name!r}: pooling_factor must be >= 0 and id_skew > 0")

    @classmethod
    def from_config(cls, config, pooling_factor: float = 1.0, weighted: bool = False,
                    id_skew: float = 1.0) -> TableSpec:
        """From an ``EmbeddingTableConfig`` (or anything with its fields; without a ``dtype``, fp32 rows)."""
        return cls(config.name, config.num_embeddings, config.embedding_dim, len(config.feature_names),
                   pooling_factor, config.pooling != "none", weighted, id_skew,
                   row_bytes=ROW_BYTES[getattr(config, "dtype", "fp32")])

    @property
    def half(self) -> bool:
        """Whether its rows are fp16: a replica round sends them as they are, in a round of their own
        (``replication/wire.py``), whatever the wire."""
        return self.row_bytes != FP32_BYTES

    @property
    def ids_per_sample(self) -> float:
        """Ids of all this table's features in one sample."""
        return self.pooling_factor * self.features

    def access_fraction(self, lo: int, hi: int) -> float:
        """Share of the table's lookups that fall on rows ``[lo, hi)``."""
        if self.id_skew == 1.0 or self.hashed:
            return (hi - lo) / self.rows
        a = 1.0 / self.id_skew
        return (hi / self.rows) ** a - (lo / self.rows) ** a

    def expected_unique(self, lo: int, hi: int, draws: float) -> float:
        """Expected number of distinct rows of ``[lo, hi)`` hit by ``draws`` lookups of the table."""
        if draws <= 0 or hi <= lo:
            return 0.0
        if self.hashed and self.id_skew != 1.0:  # any block is a fair sample of the whole table
            return (hi - lo) / self.rows * _power_law_unique(self.rows, self.id_skew, 0, self.rows, draws)
        if self.id_skew == 1.0:
            return (hi - lo) * -math.expm1(draws * math.log1p(-1.0 / self.rows)) if self.rows > 1 else 1.0
        return _power_law_unique(self.rows, self.id_skew, lo, hi, draws)


@functools.lru_cache(maxsize=4096)
def _power_law_unique(rows: int, id_skew: float, lo: int, hi: int, draws: float) -> float:
    """Expected distinct rows of ``[lo, hi)`` under ``id = floor(rows * u ** id_skew)``: rows in
    geometric buckets, uniform probability inside each bucket."""
    a = 1.0 / id_skew
    total, start = 0.0, lo
    while start < hi:
        end = min(hi, max(start + 1, int(start * 1.05) + 1))
        p = ((end / rows) ** a - (start / rows) ** a) / (end - start)
        total += (end - start) * (-math.expm1(draws * math.log1p(-p)) if p < 1 else 1.0)
        start = end
    return total


@dataclass(frozen=True)
class Workload:
    """How the tables are trained: batch, optimizer, wire type and replica reduction."""

    batch_size: int = 512  # samples per rank per step
    optimizer: str = "momentum_rowwise_adagrad"  # the strategies' sparse_optimizer default; "sgd" keeps no row state
    comm_bytes: int = FP32_BYTES  # bytes per pooled element on the wire (2 with a bf16 comm_dtype)
    sync_mode: str = "weights"  # "weights": average touched rows; "gradients": every step
    sync_interval: int = 1  # steps between reductions (sync_mode="weights")
    sync_bytes: int = FP32_BYTES  # bytes per element of the weights reduction (SYNC_BYTES of its sync_dtype)
    sync_overlap: bool = False  # the reduction runs in the background, applied sync_interval steps later
    # Column-wise cuts give each column block its own row-wise AdaGrad accumulator, which changes
    # the optimizer's arithmetic; the planner then uses them only where asked (or where exact).
    allow_column_wise: bool = False
    # (table, optimizer) of the tables trained with an optimizer of their own (the strategies' sparse_per_table)
    table_optimizers: tuple[tuple[str, str], ...] = ()

    def optimizer_of(self, table: str | None) -> str:
        """The sparse optimizer of ``table``: its own (``table_optimizers``), else ``optimizer``."""
        return dict(self.table_optimizers).get(table, self.optimizer) if table is not None else self.optimizer

    def cuts_columns(self, table: str) -> bool:
        """Whether the planner may cut ``table`` by columns: where its optimizer keeps its arithmetic so
        (``column_wise_exact``), or where ``allow_column_wise`` lets it and the optimizer reads no whole row."""
        own = dataclasses.replace(self, optimizer=self.optimizer_of(table))
        return own.optimizer not in ROW_NORM_OPTIMIZERS and (self.allow_column_wise or own.column_wise_exact)

    @property
    def sync_dtype(self) -> str:
        """The reduction's wire type of ``sync_bytes``: ``"fp32"``, ``"bf16"`` or ``"int8"``."""
        return {n: name for name, n in SYNC_BYTES.items()}[self.sync_bytes]

    @property
    def column_wise_exact(self) -> bool:
        """Whether a column-wise cut keeps this optimizer's arithmetic: no state (SGD), or only element-wise
        state (``adam``, ``adamw``: each column block updates its columns as the whole row would)."""
        return self.optimizer in ("sgd", *ELEMENTWISE_OPTIMIZERS)

    def state_per_row(self, dim: int, table: str | None = None) -> int:
        """Float32s of optimizer state a row of ``dim`` columns of ``table`` keeps (``SparseOptimizerConfig.state_shapes``
        of ``optimizer_of(table)``): none for SGD, one for row-wise AdaGrad, ``2 dim + 1`` for ``adam``, ``adamw``
        and ``lamb`` (two moments, a step count), ``dim + 2`` for ``rowwise_adam`` (one second moment a row)."""
        optimizer = self.optimizer_of(table)
        if optimizer == "sgd":
            return 0
        if optimizer == "rowwise_adam":
            return dim + 2
        return 2 * dim + 1 if optimizer in ("lamb", *ELEMENTWISE_OPTIMIZERS) else 1

    def exact_state_per_row(self, dim: int, table: str | None = None) -> int:
        """Of ``state_per_row``, the floats a replica round sends in fp32 whatever ``sync_dtype``
        (``SparseOptimizerConfig.exact_states``: the Adam family's second moment and step count)."""
        optimizer = self.optimizer_of(table)
        if optimizer == "rowwise_adam":
            return 2
        return dim + 1 if optimizer in ("lamb", *ELEMENTWISE_OPTIMIZERS) else 0


#: Sparse optimizers whose state is all element-wise: a column-wise cut keeps their arithmetic.
ELEMENTWISE_OPTIMIZERS = ("adam", "adamw")
#: Sparse optimizers that read a whole row at once (a mean or norm over its columns) and keep more than
#: one number a row: a column-wise cut changes them, and the planner and strategy refuse it.
ROW_NORM_OPTIMIZERS = ("rowwise_adam", "lamb")


def column_wise_refusal(optimizer: str, where: str) -> str:
    """The error for a column-wise cut (``where`` asks for it) under a ``ROW_NORM_OPTIMIZERS`` member."""
    what = "one second moment from the mean of g**2 over the row" if optimizer == "rowwise_adam" else \
        "its trust ratio from the norms of the whole row"
    return (f"{where} but sparse_optimizer={optimizer!r} computes {what}: a column-wise cut would give each column "
            "block its own; shard its tables table_wise, row_wise or data_parallel, or use 'adam' or 'adamw' "
            "(element-wise: exact when cut by columns)")
