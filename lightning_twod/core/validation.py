"""The content check of a batch of ids against the embedding tables that will read it.

Shapes and dtypes are the constructor's business (:class:`SparseFeatures`); this module checks
what needs a look at the contents: features that no table expects or that are missing, negative
lengths, lengths that do not sum to the number of ids, and ids outside their table's rows. The
messages name the feature, its table, the sample and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_twod.core.features import SparseFeatures


def validation_error(
    features: SparseFeatures, num_embeddings: Mapping[str, int], table_of: Mapping[str, str] | None = None
) -> str | None:
    """Check ``features`` against the embedding tables; return the error message or ``None``.

    Vectorized, no Python loop over samples: one device sync reads the signs of the lengths, the ids
    per feature and the smallest and largest id of the batch together, which settles the range when
    every id lies in the smallest table (one pass over the ids). Otherwise one more sync: when every
    feature has as many ids, each feature's smallest and largest id are compared with its table,
    else a bound is materialized per id.

    Args:
        features: the batch, ``F`` features of ``B`` samples, ``N`` ids.
        num_embeddings: every expected feature name -> number of rows of its table (valid ids
            are ``0 <= id < num_embeddings[feature]``).
        table_of: optional feature name -> table name, used in messages.

    Returns:
        ``None`` when valid, else a message naming the feature (and table), the offending value
        and a fix. Checks, in order: unknown features, missing features, negative lengths,
        ``lengths.sum() != N``, ids out of range; on the meta device only the features.
    """
    keys, values, lengths = features.keys, features.values, features.lengths
    table_of = table_of or {}

    def where(k: str) -> str:
        t = table_of.get(k)
        return f"feature {k!r} (table {t!r})" if t is not None else f"feature {k!r}"

    expected = list(num_embeddings.keys())
    unknown = [k for k in keys if k not in num_embeddings]
    if unknown:
        return (
            f"SparseFeatures has unknown feature(s) {unknown} that no embedding table expects; "
            f"expected features: {expected}. Fix: drop them from the batch "
            f"(e.g. features.permute({expected!r})) or add them to a table's feature names."
        )
    missing = [k for k in expected if k not in features]
    if missing:
        desc = ", ".join(where(k) for k in missing)
        return (
            f"SparseFeatures is missing expected feature(s): {desc}; the batch has features {keys}. "
            f"Fix: include every configured feature in the batch (use empty bags for samples without ids)."
        )
    n = values.numel()
    if not keys:
        return f"there are N={n} values but no features; give the keys and lengths of the ids" if n else None
    if values.is_meta or lengths.is_meta:  # shapes without ids (a model on the meta device): nothing more to read
        return None
    b = features.batch_size
    # one device sync for the signs, the ids per feature (cached on the batch for its lookups) and the id range
    extrema = torch.stack(values.aminmax()).to(torch.int64) if n else lengths.new_zeros(2, dtype=torch.int64)
    stats = torch.cat([(lengths < 0).any().view(1).to(torch.int64), lengths.view(len(keys), b).sum(dim=1),
                       extrema]).tolist()
    has_neg, counts, (low, high) = stats[0], stats[1:-2], stats[-2:]
    total = sum(counts)
    if has_neg:
        first = int(torch.nonzero(lengths < 0)[0, 0])
        f, s = divmod(first, b)
        k = keys[f]
        return (
            f"{where(k)} has negative length {int(lengths[first])} at sample {s}; "
            f"lengths must be >= 0. Fix: build lengths as the number of ids in each bag."
        )
    if total != n:
        # Key-major layout: the first feature whose ids would end past N (or, with too few
        # lengths, the last feature, whose bags leave values unassigned) is the one to check.
        ends = torch.cumsum(lengths.view(len(keys), b).sum(dim=1), 0).tolist()
        culprit = next((i for i, end in enumerate(ends) if end > n), len(keys) - 1)
        return (
            f"{where(keys[culprit])}: lengths sum to {total} but there are N={n} values (ids of this "
            f"feature end at {ends[culprit]}); lengths.sum() must equal values.numel(). "
            f"Fix: make lengths count the ids of every (feature, sample) bag, key-major."
        )
    features._length_per_key = counts
    if low >= 0 and high < min(int(num_embeddings[k]) for k in keys):  # every id fits the smallest table
        return None
    sizes = torch.tensor([int(num_embeddings[k]) for k in keys], dtype=torch.int64, device=features.device)
    if n and min(counts) == max(counts):  # as many ids per feature (e.g. one id a sample): per-feature extrema
        low, high = values.view(len(keys), counts[0]).aminmax(dim=1)
        if not bool(((low < 0) | (high >= sizes)).any()):
            return None
    bound = torch.repeat_interleave(sizes.repeat_interleave(b), lengths, output_size=n)
    bad = (values < 0) | (values >= bound)
    if not bool(bad.any()):
        return None
    bad_idx = torch.nonzero(bad)[:, 0]
    first = bad_idx[:1]
    count = int(bad_idx.numel())
    bag = int(torch.searchsorted(features.offsets(), first, right=True)[0]) - 1
    f, s = divmod(bag, b)
    k = keys[f]
    rows = int(num_embeddings[k])
    value = int(values[first][0])
    more = f" (and {count - 1} more out-of-range id(s))" if count > 1 else ""
    tname = table_of.get(k)
    fix_table = f"table {tname!r}" if tname is not None else "its table"
    return (
        f"{where(k)} has id {value} at sample {s}, outside the valid range [0, {rows}) "
        f"(num_embeddings={rows}){more}. Fix: hash or clamp the ids into [0, {rows}) "
        f"(e.g. ids % {rows}) or increase num_embeddings of {fix_table}."
    )
