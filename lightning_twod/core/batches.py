"""Cutting a batch of sparse features into slices of samples and joining slices again.

Both work key by key on the flat, key-major ``values`` (``core.features``): the ids of one
(key, slice) pair are one block, gathered in the order the result needs with one index
(``block_gather_index``), so values and weights are copied once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_twod.core.features import SparseFeatures, block_gather_index, exclusive_cumsum


def split_batch(features: SparseFeatures, batch_sizes: Sequence[int]) -> list[SparseFeatures]:
    """Split the samples of ``features`` into consecutive slices (e.g. one per rank).

    Args:
        batch_sizes: ``P`` non-negative sizes summing to ``B``.

    Returns:
        ``P`` :class:`SparseFeatures` with the same keys; part ``p`` holds
        samples ``sum(batch_sizes[:p]) .. sum(batch_sizes[:p+1]) - 1``, with
        lengths ``[F * batch_sizes[p]]``. Parts' values/weights are views of
        one new tensor. One device sync.

    Raises:
        ValueError: negative sizes or sizes not summing to ``B``.
    """
    sizes = [int(s) for s in batch_sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"batch_sizes must be >= 0, got {sizes}")
    if sum(sizes) != features._batch_size:
        raise ValueError(f"batch_sizes {sizes} sum to {sum(sizes)}, but the batch has {features._batch_size} samples")
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    nf = len(features._keys)
    dev = features.device
    if nf == 0:
        empty = features._values[:0]
        w = features._weights[:0] if features._weights is not None else None
        return [SparseFeatures._make([], empty, features._lengths[:0], w, s, features._index, []) for s in sizes]
    lengths_2d = features.lengths_2d()
    zero_col = torch.zeros(nf, 1, dtype=torch.int64, device=dev)
    csum = torch.cat([zero_col, torch.cumsum(lengths_2d, 1)], 1)  # [F, B+1]
    bt = torch.tensor(bounds, dtype=torch.int64, device=dev)
    begin = csum.index_select(1, bt[:-1])  # [F, P] ids before each slice, within the key
    per_block = csum.index_select(1, bt[1:]) - begin  # [F, P] ids of (key, slice)
    key_start = exclusive_cumsum(csum[:, -1])  # [F]
    src_start = key_start[:, None] + begin  # [F, P]
    gather = block_gather_index(
        src_start.t().reshape(-1), per_block.t().reshape(-1), features._values.numel()
    )  # slice-major, key-minor
    lpk_per_part: list[list[int]] = per_block.t().tolist()  # the one sync
    totals = [sum(x) for x in lpk_per_part]
    values = features._values[gather].split(totals)
    weights = features._weights[gather].split(totals) if features._weights is not None else [None] * len(sizes)
    return [
        SparseFeatures._make(
            features._keys,
            values[p],
            lengths_2d[:, bounds[p] : bounds[p + 1]].reshape(-1),
            weights[p],
            sizes[p],
            features._index,
            lpk_per_part[p],
        )
        for p in range(len(sizes))
    ]


def concat_batches(parts: Sequence[SparseFeatures]) -> SparseFeatures:
    """Concatenate batches along the sample dimension (inverse of :func:`split_batch`).

    Args:
        parts: ``P >= 1`` :class:`SparseFeatures` with identical keys (same
            order), all weighted or all unweighted, on one device.

    Returns:
        A :class:`SparseFeatures` with ``B = sum(p.batch_size)``, lengths
        ``[F * B]``, values/weights ``[sum(p.num_values)]``. No device sync.

    Raises:
        ValueError: no parts, different keys, mixed weighted/unweighted.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("concat_batches needs at least one SparseFeatures")
    first = parts[0]
    for i, p in enumerate(parts):
        if not isinstance(p, SparseFeatures):
            raise ValueError(f"part {i} is a {type(p).__name__}, not a SparseFeatures")
        if p._keys != first._keys:
            raise ValueError(f"part {i} has keys {p._keys} but part 0 has keys {first._keys}; keys must match")
        if (p._weights is None) != (first._weights is None):
            raise ValueError(
                f"part {i} is {'un' if p._weights is None else ''}weighted but part 0 is "
                f"{'un' if first._weights is None else ''}weighted; weights must be given for all parts or none"
            )
    keys = first._keys
    nf = len(keys)
    batch_size = sum(p._batch_size for p in parts)
    weighted = first._weights is not None
    if len(parts) == 1:
        return first
    if nf == 0:
        w = torch.cat([p._weights for p in parts]) if weighted else None  # type: ignore[misc]
        return SparseFeatures._make([], first._values[:0], first._lengths[:0], w, batch_size, first._index, [])
    lengths = torch.cat([p.lengths_2d() for p in parts], 1).reshape(-1)
    values_cat = torch.cat([p._values for p in parts])
    weights_cat = torch.cat([p._weights for p in parts]) if weighted else None  # type: ignore[misc]
    dev = values_cat.device
    per_key = torch.stack([p.lengths_2d().sum(1) for p in parts])  # [P, F]
    numels = torch.tensor([p._values.numel() for p in parts], dtype=torch.int64, device=dev)
    src_start = exclusive_cumsum(numels)[:, None] + exclusive_cumsum(per_key, 1)  # [P, F]
    gather = block_gather_index(src_start.t().reshape(-1), per_key.t().reshape(-1), values_cat.numel())
    values = values_cat[gather]
    weights = weights_cat[gather] if weights_cat is not None else None
    lpk = None
    if all(p._length_per_key is not None for p in parts):
        lpk = [sum(x) for x in zip(*(p._length_per_key for p in parts))]  # type: ignore[misc]
    return SparseFeatures._make(list(keys), values, lengths, weights, batch_size, first._index, lpk)
