"""Keyed jagged batches of sparse categorical ids.

:class:`SparseFeatures` holds, for ``F`` named features and a batch of ``B``
samples, a variable-length *bag* of integer ids per (feature, sample) pair.
The layout is the one of TorchRec's ``KeyedJaggedTensor``: all ids are stored
in one flat ``values`` tensor, key-major, and ``lengths`` gives the size of
every bag, also key-major (the ``B`` bag lengths of key 0, then the ``B`` bag
lengths of key 1, ...).

Example with 2 features and a batch of 3 samples::

                 sample 0   sample 1   sample 2
    user_id      [1]        [2, 3]     []
    item_id      [4]        []         [5]

    keys    = ["user_id", "item_id"]                 # F = 2
    values  = [1, 2, 3,   4, 5]                      # N = 5 ids, int64 [N]
               '-user-'  '-item-'
    lengths = [1, 2, 0,   1, 0, 1]                   # int64 [F * B] = [6]
               '-user-'  '-item-'
    weights = None or float [N] (one weight per id)

    offsets()       = [0, 1, 3, 3, 4, 4, 5]          # int64 [F * B + 1]
    key_offsets()   = [0, 3, 5]                      # int64 [F + 1]
    length_per_key()= [3, 2]
    offset_per_key()= [0, 3, 5]                      # ints, as TorchRec's KJT
    lengths_2d()    = [[1, 2, 0],
                       [1, 0, 1]]                    # int64 [F, B]

The constructor only checks shapes and dtypes (cheap, no device sync).  The
content checks (negative lengths, lengths not summing to the number of ids,
ids outside their table) live in :mod:`lightning_twod.core.validation`, called by
:meth:`SparseFeatures.validate` / :meth:`SparseFeatures.validation_error`, so that hot paths
can skip them.

Instances are treated as immutable: methods return new objects (which may
share storage with the original) and never modify tensors in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_twod.core.validation import validation_error

__all__ = ["JaggedIds", "SparseFeatures"]


class JaggedIds(NamedTuple):
    """The ids of one feature of a :class:`SparseFeatures` batch.

    Attributes:
        values: int64 ``[n]`` ids of this feature, sample-major (a view).
        lengths: int64 ``[B]`` number of ids of each sample (a view).
        weights: float ``[n]`` per-id weights (a view), or ``None``.
    """

    values: Tensor
    lengths: Tensor
    weights: Tensor | None


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def block_gather_index(starts: Tensor, sizes: Tensor, total: int) -> Tensor:
    """Index that concatenates blocks of a flat tensor.

    ``src[index]`` equals ``cat([src[starts[k]:starts[k] + sizes[k]] for k])``.

    Args:
        starts: int64 ``[K]`` start of each block in the source.
        sizes: int64 ``[K]`` size of each block; ``sizes.sum() == total``.
        total: number of elements of the result.

    Returns:
        int64 ``[total]`` gather index.
    """
    dest_starts = torch.cumsum(sizes, 0) - sizes
    shift = torch.repeat_interleave(starts - dest_starts, sizes, output_size=total)
    return shift + torch.arange(total, dtype=torch.int64, device=starts.device)


def exclusive_cumsum(x: Tensor, dim: int = 0) -> Tensor:
    """The sum of the elements before each one along ``dim`` (``cumsum - x``), same shape as ``x``."""
    return torch.cumsum(x, dim) - x


class SparseFeatures:
    """A keyed jagged batch of sparse ids (see the module docstring for the layout).

    Args:
        keys: the ``F`` feature names (distinct strings).
        values: integer ``[N]`` ids, key-major. int32 (or other integer
            types) are converted to int64.
        lengths: integer ``[F * B]`` bag sizes, key-major.
        weights: optional floating ``[N]`` per-id weights.
        batch_size: ``B``. Required when there are no keys; otherwise
            ``B = lengths.numel() // F`` and, if given, must agree.

    Raises:
        ValueError: repeated or non-string keys, ``values`` / ``lengths`` not
            1-D integer tensors, ``lengths.numel()`` not a multiple of ``F``,
            ``weights.shape != values.shape`` or non-floating weights,
            tensors on different devices, missing/inconsistent batch size.
    """

    __slots__ = ("_keys", "_values", "_lengths", "_weights", "_batch_size", "_index", "_length_per_key")

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None = None,
        batch_size: int | None = None,
    ) -> None:
        if isinstance(keys, str):
            raise ValueError(f"keys must be a sequence of feature names, got the string {keys!r}")
        keys = list(keys)
        for k in keys:
            if not isinstance(k, str):
                raise ValueError(f"feature names must be strings, got {k!r} of type {type(k).__name__}")
        index = {k: i for i, k in enumerate(keys)}
        if len(index) != len(keys):
            dups = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"feature names must be unique, but {dups} appear more than once in keys={keys}")
        values = self._check_ids_tensor("values", values)
        lengths = self._check_ids_tensor("lengths", lengths)
        if lengths.device != values.device:
            raise ValueError(f"values is on {values.device} but lengths is on {lengths.device}; put them on one device")
        if weights is not None:
            if not isinstance(weights, Tensor):
                raise ValueError(f"weights must be a torch.Tensor or None, got {type(weights).__name__}")
            if weights.shape != values.shape:
                raise ValueError(
                    f"weights must have the shape of values {tuple(values.shape)} (one weight per id), "
                    f"got {tuple(weights.shape)}"
                )
            if not weights.dtype.is_floating_point:
                raise ValueError(f"weights must be a floating point tensor, got dtype {weights.dtype}")
            if weights.device != values.device:
                raise ValueError(f"values is on {values.device} but weights is on {weights.device}")
        num_features = len(keys)
        if batch_size is not None:
            batch_size = int(batch_size)
            if batch_size < 0:
                raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        if num_features == 0:
            if batch_size is None:
                raise ValueError("batch_size is required when there are no keys (it cannot be inferred from lengths)")
            if lengths.numel() != 0:
                raise ValueError(f"there are no keys, so lengths must be empty, got {lengths.numel()} lengths")
        else:
            if lengths.numel() % num_features != 0:
                raise ValueError(
                    f"lengths has {lengths.numel()} entries, which is not a multiple of the number of "
                    f"features F={num_features} (lengths must be [F * B], key-major)"
                )
            inferred = lengths.numel() // num_features
            if batch_size is not None and batch_size != inferred:
                raise ValueError(
                    f"batch_size={batch_size} disagrees with lengths: {lengths.numel()} lengths for "
                    f"{num_features} features means a batch of {inferred}"
                )
            batch_size = inferred
        self._keys = keys
        self._values = values
        self._lengths = lengths
        self._weights = weights
        self._batch_size = batch_size
        self._index = index
        self._length_per_key: list[int] | None = None

    @staticmethod
    def _check_ids_tensor(name: str, t: Any) -> Tensor:
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D tensor, got shape {tuple(t.shape)}")
        if not _is_integer_dtype(t.dtype):
            raise ValueError(f"{name} must be an integer tensor (int64 or int32), got dtype {t.dtype}")
        if t.dtype != torch.int64:
            t = t.to(torch.int64)
        return t

    @classmethod
    def _make(
        cls,
        keys: list[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        batch_size: int,
        index: dict[str, int] | None = None,
        length_per_key: list[int] | None = None,
    ) -> SparseFeatures:
        """Build without any checks (inputs already known to be consistent)."""
        obj = cls.__new__(cls)
        obj._keys = keys
        obj._values = values
        obj._lengths = lengths
        obj._weights = weights
        obj._batch_size = batch_size
        obj._index = index if index is not None else {k: i for i, k in enumerate(keys)}
        obj._length_per_key = length_per_key
        return obj

    # ------------------------------------------------------------------ basics

    @property
    def keys(self) -> list[str]:
        """The ``F`` feature names, in storage order."""
        return list(self._keys)

    @property
    def values(self) -> Tensor:
        """int64 ``[N]`` ids, key-major."""
        return self._values

    @property
    def lengths(self) -> Tensor:
        """int64 ``[F * B]`` bag sizes, key-major."""
        return self._lengths

    @property
    def weights(self) -> Tensor | None:
        """Floating ``[N]`` per-id weights, or ``None``."""
        return self._weights

    @property
    def batch_size(self) -> int:
        """``B``, the number of samples."""
        return self._batch_size

    @property
    def num_features(self) -> int:
        """``F``, the number of features."""
        return len(self._keys)

    @property
    def num_values(self) -> int:
        """``N``, the total number of ids (no device sync)."""
        return self._values.numel()

    @property
    def device(self) -> torch.device:
        """Device of the tensors."""
        return self._values.device

    def lengths_2d(self) -> Tensor:
        """Bag sizes as an int64 ``[F, B]`` view of :attr:`lengths`."""
        return self._lengths.view(len(self._keys), self._batch_size)

    def length_per_key(self) -> list[int]:
        """Number of ids of each feature, ``F`` ints (one device sync, then cached).

        On the meta device (shapes, no ids) the ``N`` ids are split evenly over the features, the
        remainder to the first, as TorchRec's ``KeyedJaggedTensor`` does, so that shapes propagate.
        """
        if self._length_per_key is None:
            if self._values.is_meta or self._lengths.is_meta:
                share, rest = divmod(self.num_values, len(self._keys)) if self._keys else (0, 0)
                self._length_per_key = [share + (rest if i == 0 else 0) for i in range(len(self._keys))]
            else:
                self._length_per_key = [int(x) for x in self.lengths_2d().sum(1).tolist()]
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Start of each feature's ids in :attr:`values`, ``F + 1`` ints (leading 0, last = N), as
        TorchRec's ``KeyedJaggedTensor.offset_per_key``; :meth:`key_offsets` as a tensor, with no sync."""
        offsets = [0]
        for count in self.length_per_key():
            offsets.append(offsets[-1] + count)
        return offsets

    def offsets(self) -> Tensor:
        """int64 ``[F * B + 1]`` start of every bag in :attr:`values` (cumulative lengths, leading 0)."""
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        return torch.cat([zero, torch.cumsum(self._lengths, 0)])

    def key_offsets(self) -> Tensor:
        """int64 ``[F + 1]`` start of each feature's ids in :attr:`values` (leading 0, last = N)."""
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        return torch.cat([zero, torch.cumsum(self.lengths_2d().sum(1), 0)])

    def __contains__(self, key: object) -> bool:
        return key in self._index

    # Not iterable (``__getitem__`` takes feature names): use ``.keys``.
    __iter__ = None  # type: ignore[assignment]

    def __getitem__(self, key: str) -> JaggedIds:
        """The ids of one feature as views: values ``[n]``, lengths ``[B]``, weights ``[n]`` or None."""
        try:
            i = self._index[key]
        except (KeyError, TypeError):
            raise KeyError(f"unknown feature {key!r}; features are {self._keys}") from None
        lpk = self._length_per_key if self._length_per_key is not None else self.length_per_key()
        start = sum(lpk[:i])
        end = start + lpk[i]
        b = self._batch_size
        weights = self._weights[start:end] if self._weights is not None else None
        return JaggedIds(self._values[start:end], self._lengths[i * b : (i + 1) * b], weights)

    def __repr__(self) -> str:
        return (
            f"SparseFeatures(keys={self._keys}, batch_size={self._batch_size}, num_values={self.num_values}, "
            f"weighted={self._weights is not None}, device={self.device})"
        )

    def equal(self, other: SparseFeatures) -> bool:
        """Exact comparison (keys, batch size, device, dtypes and all tensor contents)."""
        if not isinstance(other, SparseFeatures):
            return False
        if self._keys != other._keys or self._batch_size != other._batch_size or self.device != other.device:
            return False
        if (self._weights is None) != (other._weights is None):
            return False
        if not (torch.equal(self._values, other._values) and torch.equal(self._lengths, other._lengths)):
            return False
        if self._weights is not None:
            assert other._weights is not None
            return self._weights.dtype == other._weights.dtype and torch.equal(self._weights, other._weights)
        return True

    # ------------------------------------------------------------ construction

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> SparseFeatures:
        """Build from Python lists: ``{"user_id": [[1], [2, 3], []], "item_id": [[4], [], [5]]}``.

        Args:
            data: feature name -> ``B`` bags of ids (every feature the same ``B``).
            weights: optional feature name -> ``B`` bags of weights, each bag the
                size of the matching id bag. Features left out get weight 1.0.
                When ``None`` the result is unweighted.

        Returns:
            A CPU :class:`SparseFeatures` with int64 values ``[N]``, lengths
            ``[F * B]`` and float32 weights ``[N]`` (or ``None``).

        Raises:
            ValueError: features with different numbers of samples, weights for
                an unknown feature or with a bag size different from the ids.
        """
        keys = list(data.keys())
        batch_size = None
        first_key = None
        for k in keys:
            n = len(data[k])
            if batch_size is None:
                batch_size, first_key = n, k
            elif n != batch_size:
                raise ValueError(
                    f"feature {k!r} has {n} samples but feature {first_key!r} has {batch_size}; "
                    f"every feature must have the same number of samples (the batch size)"
                )
        if weights is not None:
            unknown = [k for k in weights if k not in data]
            if unknown:
                raise ValueError(f"weights given for unknown feature(s) {unknown}; features are {keys}")
        flat_values: list[int] = []
        flat_lengths: list[int] = []
        flat_weights: list[float] = []
        for k in keys:
            bags = data[k]
            wbags = weights.get(k) if weights is not None else None
            if wbags is not None and len(wbags) != len(bags):
                raise ValueError(f"feature {k!r} has {len(bags)} samples of ids but {len(wbags)} samples of weights")
            for b, bag in enumerate(bags):
                bag = list(bag)
                flat_values.extend(bag)
                flat_lengths.append(len(bag))
                if weights is not None:
                    if wbags is None:
                        flat_weights.extend([1.0] * len(bag))
                    else:
                        wbag = list(wbags[b])
                        if len(wbag) != len(bag):
                            raise ValueError(
                                f"feature {k!r} sample {b} has {len(bag)} ids but {len(wbag)} weights; "
                                f"give one weight per id"
                            )
                        flat_weights.extend(float(w) for w in wbag)
        values = torch.tensor(flat_values, dtype=torch.int64)
        lengths = torch.tensor(flat_lengths, dtype=torch.int64)
        w = torch.tensor(flat_weights, dtype=torch.float32) if weights is not None else None
        return cls(keys, values, lengths, w, batch_size=batch_size if batch_size is not None else 0)

    @classmethod
    def from_padded(
        cls,
        ids: Mapping[str, Tensor],
        padding_value: int = -1,
        weights: Mapping[str, Tensor] | None = None,
    ) -> SparseFeatures:
        """Build from dense padded id tensors, one per feature.

        Args:
            ids: feature name -> integer ``[B, L_key]`` ids (``L_key`` may differ
                per feature) or ``[B]`` (one id per sample). Entries equal to
                ``padding_value`` are dropped, wherever they are in the row.
            padding_value: the padding id.
            weights: optional feature name -> floating tensor of the shape of
                that feature's ids. Features left out get weight 1.0. When
                ``None`` the result is unweighted.

        Returns:
            A :class:`SparseFeatures` on the device of the inputs, values ``[N]``,
            lengths ``[F * B]``, weights ``[N]`` or ``None``.

        Raises:
            ValueError: wrong rank or dtype, different ``B`` across features,
                weights for an unknown feature or of the wrong shape.
        """
        keys = list(ids.keys())
        if weights is not None:
            unknown = [k for k in weights if k not in ids]
            if unknown:
                raise ValueError(f"weights given for unknown feature(s) {unknown}; features are {keys}")
        w_dtype: torch.dtype | None = None
        if weights is not None:
            for k, w in weights.items():
                if not isinstance(w, Tensor) or not w.dtype.is_floating_point:
                    raise ValueError(f"weights for feature {k!r} must be a floating point tensor")
                w_dtype = w.dtype if w_dtype is None else torch.promote_types(w_dtype, w.dtype)
            if w_dtype is None:
                w_dtype = torch.float32
        batch_size = None
        first_key = None
        vals: list[Tensor] = []
        lens: list[Tensor] = []
        wts: list[Tensor] = []
        device = None
        for k in keys:
            t = ids[k]
            if not isinstance(t, Tensor):
                t = torch.as_tensor(t)
            if t.dim() == 1:
                t = t.unsqueeze(1)
            elif t.dim() != 2:
                raise ValueError(f"ids of feature {k!r} must be [B, L] or [B], got shape {tuple(ids[k].shape)}")
            if not _is_integer_dtype(t.dtype):
                raise ValueError(f"ids of feature {k!r} must be an integer tensor, got dtype {t.dtype}")
            if batch_size is None:
                batch_size, first_key, device = t.shape[0], k, t.device
            elif t.shape[0] != batch_size:
                raise ValueError(
                    f"feature {k!r} has {t.shape[0]} samples but feature {first_key!r} has {batch_size}; "
                    f"every feature must have the same number of samples (the batch size)"
                )
            mask = t != padding_value
            lens.append(mask.sum(1, dtype=torch.int64))
            vals.append(t[mask].to(torch.int64))
            if weights is not None:
                assert w_dtype is not None
                w = weights.get(k)
                if w is None:
                    wts.append(torch.ones(vals[-1].shape, dtype=w_dtype, device=t.device))
                else:
                    w2 = w.unsqueeze(1) if w.dim() == 1 else w
                    if w2.shape != t.shape:
                        raise ValueError(
                            f"weights of feature {k!r} have shape {tuple(w.shape)} but its ids have shape "
                            f"{tuple(ids[k].shape)}; they must match"
                        )
                    wts.append(w2[mask].to(w_dtype))
        if device is None:
            device = torch.device("cpu")
        values = torch.cat(vals) if vals else torch.zeros(0, dtype=torch.int64, device=device)
        lengths = torch.cat(lens) if lens else torch.zeros(0, dtype=torch.int64, device=device)
        w_out = None
        if weights is not None:
            assert w_dtype is not None
            w_out = torch.cat(wts) if wts else torch.zeros(0, dtype=w_dtype, device=device)
        return cls(keys, values, lengths, w_out, batch_size=batch_size if batch_size is not None else 0)

    def to_dict(self) -> dict[str, list[list[int]]]:
        """Feature name -> ``B`` bags of ids as Python lists (for tests and debugging)."""
        values = self._values.tolist()
        lengths = self._lengths.tolist()
        out: dict[str, list[list[int]]] = {}
        pos = 0
        b = self._batch_size
        for i, k in enumerate(self._keys):
            bags = []
            for n in lengths[i * b : (i + 1) * b]:
                bags.append(values[pos : pos + n])
                pos += n
            out[k] = bags
        return out

    # ----------------------------------------------------------------- devices

    def to(self, device: torch.device | str | int, non_blocking: bool = False) -> SparseFeatures:
        """Copy to ``device`` (returns ``self`` when already there). Used by Lightning to move batches."""
        values = self._values.to(device, non_blocking=non_blocking)
        lengths = self._lengths.to(device, non_blocking=non_blocking)
        weights = self._weights.to(device, non_blocking=non_blocking) if self._weights is not None else None
        if values is self._values and lengths is self._lengths and weights is self._weights:
            return self
        return self._make(
            self._keys, values, lengths, weights, self._batch_size, self._index, self._length_per_key
        )

    def pin_memory(self) -> SparseFeatures:
        """Copy into page-locked host memory (called by ``DataLoader(pin_memory=True)``)."""
        weights = self._weights.pin_memory() if self._weights is not None else None
        return self._make(
            self._keys,
            self._values.pin_memory(),
            self._lengths.pin_memory(),
            weights,
            self._batch_size,
            self._index,
            self._length_per_key,
        )

    # -------------------------------------------------------------- validation

    def validation_error(
        self, num_embeddings: Mapping[str, int], table_of: Mapping[str, str] | None = None
    ) -> str | None:
        """The content check against the tables (:func:`lightning_twod.core.validation.validation_error`):
        ``None`` when valid, else a message naming the feature, its table and the fix."""
        return validation_error(self, num_embeddings, table_of)

    def validate(self, num_embeddings: Mapping[str, int], table_of: Mapping[str, str] | None = None) -> None:
        """Raise ``ValueError`` with :meth:`validation_error`'s message if the batch is invalid."""
        msg = self.validation_error(num_embeddings, table_of)
        if msg is not None:
            raise ValueError(msg)

    # --------------------------------------------------------- transformations

    def permute(self, keys: Sequence[str]) -> SparseFeatures:
        """Reorder features, or select a subset of them, copying the data.

        Args:
            keys: ``F'`` distinct feature names, each present in :attr:`keys`.

        Returns:
            A :class:`SparseFeatures` with keys ``keys``, lengths ``[F' * B]``
            and values/weights ``[N']`` (the ids of the selected features).

        Raises:
            KeyError: a name that is not a feature. ValueError: repeated names.
        """
        if isinstance(keys, str):
            raise ValueError(f"keys must be a sequence of feature names, got the string {keys!r}")
        keys = list(keys)
        missing = [k for k in keys if k not in self._index]
        if missing:
            raise KeyError(f"cannot permute to unknown feature(s) {missing}; features are {self._keys}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"permute keys must be unique, got {keys}")
        idx = [self._index[k] for k in keys]
        lpk_all = self.length_per_key()
        lpk = [lpk_all[i] for i in idx]
        total = sum(lpk)
        starts_all = [0]
        for x in lpk_all[:-1]:
            starts_all.append(starts_all[-1] + x)
        dev = self.device
        idx_t = torch.tensor(idx, dtype=torch.int64, device=dev)
        lengths = self.lengths_2d().index_select(0, idx_t).reshape(-1)
        gather = block_gather_index(
            torch.tensor([starts_all[i] for i in idx], dtype=torch.int64, device=dev),
            torch.tensor(lpk, dtype=torch.int64, device=dev),
            total,
        )
        values = self._values[gather]
        weights = self._weights[gather] if self._weights is not None else None
        return self._make(keys, values, lengths, weights, self._batch_size, length_per_key=lpk)

    def split_batch(self, batch_sizes: Sequence[int]) -> list[SparseFeatures]:
        """Split the samples into consecutive slices (e.g. one per rank; ``core.batches.split_batch``).

        Args:
            batch_sizes: ``P`` non-negative sizes summing to ``B``.

        Returns:
            ``P`` :class:`SparseFeatures` with the same keys; part ``p`` holds
            samples ``sum(batch_sizes[:p]) .. sum(batch_sizes[:p+1]) - 1``, with
            lengths ``[F * batch_sizes[p]]``. One device sync.

        Raises:
            ValueError: negative sizes or sizes not summing to ``B``.
        """
        from lightning_twod.core.batches import split_batch

        return split_batch(self, batch_sizes)

    @staticmethod
    def concat_batches(parts: Sequence[SparseFeatures]) -> SparseFeatures:
        """Concatenate batches along the sample dimension (inverse of :meth:`split_batch`;
        ``core.batches.concat_batches``).

        Raises:
            ValueError: no parts, different keys, mixed weighted/unweighted.
        """
        from lightning_twod.core.batches import concat_batches

        return concat_batches(parts)

    # ------------------------------------------------------------ TorchRec interop

    def to_kjt(self) -> Any:
        """Convert to ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor`` (shares tensors; ``sparse.kjt``).

        Raises:
            ImportError: torchrec is not installed.
        """
        from lightning_twod.core.kjt import to_kjt

        return to_kjt(self)

    @classmethod
    def from_kjt(cls, kjt: Any) -> SparseFeatures:
        """Build from a TorchRec ``KeyedJaggedTensor`` (or any object with ``keys()``, ``values()``,
        ``lengths()`` and ``weights_or_none()``); shares tensors where the dtypes are already int64.

        Raises:
            ValueError: a variable-batch KJT (different batch size per key), or inconsistent tensors.
        """
        from lightning_twod.core.kjt import from_kjt

        return from_kjt(kjt)
