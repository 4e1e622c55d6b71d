"""Corrupted copies of ``sparse_cases``' batches, and what the error each one raises must say.

``bad_batch(good, kind)`` for each ``kind`` in ``KINDS``; the good batch of rank ``r`` is
``random_batch(sum(BATCH_SIZES), seed=BATCH_SEED).split_batch(BATCH_SIZES)[r]``.
"""

from __future__ import annotations

import torch

from lightning_twod.core.features import SparseFeatures

BATCH_SEED = 7
BATCH_SIZES = [3, 3, 2, 3]


def _block(features: SparseFeatures, key: str) -> tuple[int, int]:
    """``(start, end)`` of ``key``'s ids in ``features.values``."""
    i = features.keys.index(key)
    lpk = features.length_per_key()
    return sum(lpk[:i]), sum(lpk[:i + 1])


def bad_batch(good: SparseFeatures, kind: str) -> tuple[SparseFeatures, list[str]]:
    """A corrupted copy of ``good`` and the strings its error message must contain.

    Built with the plain constructor (which checks only shapes), so the content checks of the
    collections are what must catch it.
    """
    keys = good.keys
    values, lengths = good.values.clone(), good.lengths.clone()
    weights = good.weights.clone() if good.weights is not None else None
    b = good.batch_size
    if kind in ("id_too_large", "id_negative"):
        # f_rw_shared reads table t_rw (53 rows): the message must name both feature and table
        start, end = _block(good, "f_rw_shared")
        assert end > start, "test batch needs an id of f_rw_shared on rank 1"
        bad = 53 + 1000 if kind == "id_too_large" else -3
        values[end - 1] = bad
        return SparseFeatures(keys, values, lengths, weights), [
            "'f_rw_shared'", "'t_rw'", f"id {bad}", "[0, 53)"]
    if kind == "negative_length":
        # bag 0 of f_tw gets length -2; its ids move to bag 1, so lengths still sum to N
        i = keys.index("f_tw") * b
        lengths[i + 1] += lengths[i] + 2
        lengths[i] = -2
        assert int(lengths.sum()) == values.numel()
        return SparseFeatures(keys, values, lengths, weights), ["'f_tw'", "'t_tw'", "negative length -2"]
    if kind == "lengths_sum":
        # one more id claimed by bag 0 of f_dp than the values hold: the ids of the last
        # feature (f_tw2) now end past N, and the message names it
        lengths[keys.index("f_dp") * b] += 1
        total = int(lengths.sum())
        assert keys[-1] == "f_tw2"
        return SparseFeatures(keys, values, lengths, weights), [
            "'f_tw2'", f"sum to {total}", f"N={values.numel()}"]
    if kind == "unknown_key":
        extra = torch.tensor([1] + [0] * (b - 1))
        values = torch.cat([values, torch.tensor([0])])
        weights = torch.cat([weights, torch.ones(1)]) if weights is not None else None
        return SparseFeatures(keys + ["f_bogus"], values, torch.cat([lengths, extra]), weights), ["'f_bogus'"]
    if kind == "missing_key":
        i = keys.index("f_cw")
        start, end = _block(good, "f_cw")
        keep = torch.cat([torch.arange(start), torch.arange(end, values.numel())])
        lengths = torch.cat([lengths[:i * b], lengths[(i + 1) * b:]])
        weights = weights[keep] if weights is not None else None
        return SparseFeatures(keys[:i] + keys[i + 1:], values[keep], lengths, weights), ["'f_cw'", "'t_cw'"]
    raise AssertionError(kind)


KINDS = ["id_too_large", "id_negative", "negative_length", "lengths_sum", "unknown_key", "missing_key"]
