"""Lookup statistics of a model's tables (what ``TableSpec`` reads), estimated from one batch of ids.

Per table, from the ids of its features in the batch:

* ``pooling_factor``: ids / (samples x the table's features in the batch);
* ``id_skew``: the skew whose expected number of distinct rows under the planner's own model
  (``TableSpec.expected_unique``: ``id = floor(rows * u ** id_skew)``) equals the batch's, found by
  bisection. A distinct count does not depend on which rows are the popular ones, so it reads hashed
  ids as well; ``[1, MAX_SKEW]``, and 1 (uniform) where the count is within 3 standard deviations of
  uniform ids' (few repeats tell little);
* ``hashed``: the popular rows are not the lowest ids: the order-based estimate
  ``mean(-log((id + 0.5) / rows))`` (about ``id_skew`` for the power law on the lowest ids, about 1
  for scattered ids) is nearer 1 than ``id_skew``, for a table found skewed (``id_skew > HASHED_MIN_SKEW``);
* ``weighted``: the batch carries per-id weights.

``check_lookup_stats`` checks statistics a user gives (``lookup_stats={table: {field: value}}``).
The batch's tensors are read through their own methods: importing this module loads no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

from lightning_twod.planner.inputs import TableSpec

#: The fields of a table's statistics, as ``TableSpec`` names them.
STAT_FIELDS = ("pooling_factor", "id_skew", "hashed", "weighted")
#: The largest ``id_skew`` estimated (``id = floor(rows * u ** 16)``: half the lookups on 0.001 % of the rows).
MAX_SKEW = 16.0
#: Below this estimated skew the ids count as uniform, and ``hashed`` (the same for uniform ids) stays False.
HASHED_MIN_SKEW = 1.25
_BISECTIONS = 40


def estimate_lookup_stats(features: Any, tables: Mapping[str, tuple[int, Sequence[str]]]
                          ) -> dict[str, dict[str, Any]]:
    """Per table, ``{"pooling_factor", "id_skew", "hashed", "weighted"}`` estimated from one batch.

    Args:
        features: one batch: a ``SparseFeatures`` of ``F`` features and ``B`` samples (values int64
            ``[N]``, lengths ``[F * B]``, weights ``[N]`` or None), or a TorchRec ``KeyedJaggedTensor``.
        tables: table name -> ``(rows, feature names)`` (``EmbeddingTableConfig.num_embeddings`` and
            ``feature_names``).

    Returns:
        ``{table: stats}`` for each table with at least one id in the batch (features it reads that
        the batch lacks do not count).
    """
    from lightning_twod.core.features import SparseFeatures  # a batch in hand: torch is loaded already

    if not isinstance(features, SparseFeatures):
        features = SparseFeatures.from_kjt(features)
    stats = {}
    for table, (rows, names) in tables.items():
        present = [name for name in names if name in features]
        ids = features.permute(present).values if present else None  # int64 [n]: the table's ids
        if ids is None or ids.numel() == 0:
            continue
        draws = ids.numel()
        skew = skew_from_distinct(rows, draws, ids.unique().numel())
        by_order = ((ids.clamp(0, rows - 1).double() + 0.5) / rows).log().neg().mean().item()
        stats[table] = {"pooling_factor": round(draws / (features.batch_size * len(present)), 3),
                        "id_skew": round(skew, 3),
                        "hashed": skew > HASHED_MIN_SKEW and by_order < (1 + skew) / 2,
                        "weighted": features.weights is not None}
    return stats


def skew_from_distinct(rows: int, draws: int, distinct: int) -> float:
    """The ``id_skew`` in ``[1, MAX_SKEW]`` at which ``draws`` lookups of a table of ``rows`` rows are
    expected to hit ``distinct`` rows (``TableSpec.expected_unique``, decreasing in the skew); 1 where
    uniform ids hit that many within 3 standard deviations."""
    def expected(skew: float) -> float:
        return TableSpec("sample", rows, 1, id_skew=skew).expected_unique(0, rows, draws)

    if rows < 2:
        return 1.0
    load = draws / rows  # the spread of the rows uniform ids leave untouched (occupancy of rows bins)
    spread = math.sqrt(rows * math.exp(-load) * max(0.0, 1 - (1 + load) * math.exp(-load)))
    if distinct >= expected(1.0) - 3 * spread:
        return 1.0
    if distinct <= expected(MAX_SKEW):
        return MAX_SKEW
    low, high = 1.0, MAX_SKEW
    for _ in range(_BISECTIONS):  # on a log scale
        middle = math.sqrt(low * high)
        low, high = (middle, high) if expected(middle) > distinct else (low, middle)
    return math.sqrt(low * high)


def check_lookup_stats(stats: Any) -> str:
    """What is wrong with user-given statistics (``{table: {field: value}}``, fields ``STAT_FIELDS``), or ``""``."""
    if not isinstance(stats, Mapping):
        return f"{stats!r} is not a mapping of table names to statistics"
    for table, entry in stats.items():
        if not isinstance(table, str) or not isinstance(entry, Mapping):
            return f"entry {table!r}: {entry!r}; give each table (by name) a mapping of {', '.join(STAT_FIELDS)}"
        unknown = sorted(set(entry) - set(STAT_FIELDS))
        if unknown:
            return f"table {table!r} has unknown fields {unknown}; the fields are {list(STAT_FIELDS)}"
        for field, value in entry.items():
            number = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
            if field == "pooling_factor" and not (number and value >= 0):
                return f"table {table!r}: pooling_factor={value!r}; use ids per sample and feature, a number >= 0"
            if field == "id_skew" and not (number and value > 0):
                return (f"table {table!r}: id_skew={value!r}; use a number > 0 (1: uniform; "
                        "id = floor(rows * u ** id_skew))")
            if field in ("hashed", "weighted") and not isinstance(value, bool):
                return f"table {table!r}: {field}={value!r}; use True or False"
    return ""


def describe_stats(stats: Mapping[str, Mapping[str, Any]]) -> str:
    """``stats``'s ranges in a few words: ``"ids per feature 1-10, id_skew 1-3.1, 2 hashed, 1 weighted"``."""
    if not stats:
        return "none"
    def span(field: str) -> str:
        values = [entry[field] for entry in stats.values() if field in entry]
        low, high = (f"{min(values):.3g}", f"{max(values):.3g}") if values else ("1", "1")
        return low if low == high else f"{low}-{high}"

    text = f"ids per feature {span('pooling_factor')}, id_skew {span('id_skew')}"
    for flag in ("hashed", "weighted"):
        count = sum(bool(entry.get(flag)) for entry in stats.values())
        text += f", {count} {flag}" if count else ""
    return text
