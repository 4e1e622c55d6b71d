"""Output types of embedding lookups.

``PooledEmbeddings`` holds one ``[B, sum(D_f)]`` tensor for all features of a collection and
hands out per-feature ``[B, D_f]`` views of it, so the concatenation that a model usually feeds
to its interaction layer costs no extra copy::

    out = ebc(features)           # features "user_id" (D=4) and "item_id" (D=8), B samples
    out["item_id"]                # [B, 8] view of out.values()[:, 4:12]
    out.values()                  # [B, 12]

It behaves like TorchRec's ``KeyedTensor`` where models touch it (``keys()``, ``values()``,
``out["f"]``, ``to_dict()``, ``length_per_key()``). ``JaggedEmbeddings`` is the unpooled (sequence)
result of one feature: one vector per id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


class PooledEmbeddings(Mapping[str, Tensor]):
    """Per-feature pooled vectors sharing one ``[B, sum(D_f)]`` buffer, in feature order.

    ``values`` is the buffer, or a function that returns it (then ``batch_size`` is required): a
    sharded lookup passes the function that waits for its all-to-all, which runs the first time
    the result is read (``values()``, a feature, ``to_dict()``), like TorchRec's lazy awaitables.
    It runs in the grad and inference modes of the lookup, wherever the first read happens.
    """

    def __init__(self, keys: Sequence[str], dims: Sequence[int], values: Tensor | Callable[[], Tensor],
                 batch_size: int | None = None) -> None:
        self._keys = list(keys)
        self._dims = list(dims)
        self._pending = None if isinstance(values, Tensor) else values
        if self._pending is None:
            self._values: Tensor | None = self._checked(values)
            if batch_size not in (None, values.shape[0]):
                raise ValueError(f"PooledEmbeddings: batch_size={batch_size} but values has {values.shape[0]} rows")
            batch_size = values.shape[0]
        elif not callable(values):
            raise TypeError(f"PooledEmbeddings: values must be a Tensor or a function returning one, got {type(values)}")
        elif batch_size is None:
            raise ValueError("PooledEmbeddings: give batch_size with a function that returns the values")
        else:
            self._values = None
        self.batch_size = batch_size
        self._split: dict[str, Tensor] | None = None
        self._split_version = -1
        self._grad_mode, self._inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def _checked(self, values: Tensor) -> Tensor:
        if values.dim() != 2 or values.shape[1] != sum(self._dims):
            raise ValueError(
                f"values must be [B, {sum(self._dims)}] for dims {self._dims}, got {list(values.shape)}"
            )
        return values

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self._keys)

    @property
    def dims(self) -> list[int]:
        """Embedding dimension of each feature, in key order."""
        return list(self._dims)

    def values(self) -> Tensor:  # type: ignore[override]
        """All features concatenated in key order: ``[B, sum(D_f)]``."""
        if self._values is None:
            pending, self._pending = self._pending, None
            with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad_mode):
                self._values = self._checked(pending())
        return self._values

    def __getitem__(self, key: str) -> Tensor:
        """``[B, D_key]`` view of the shared buffer."""
        return self._views()[key]

    def _views(self) -> dict[str, Tensor]:
        """Every feature's view, made by one ``torch.split``: one autograd node whose backward
        writes each feature's gradient into one ``[B, sum(D_f)]`` tensor. (A view per feature made
        by slicing would give each feature a backward that fills a whole ``[B, sum(D_f)]`` tensor
        of zeros around its columns, and then sum them: F full-size passes instead of one.) As with
        TorchRec's ``KeyedTensor.to_dict``, autograd does not let these views be modified in place;
        after the buffer itself was modified in place, the views are made again."""
        values = self.values()
        version = 0 if values.is_inference() else values._version  # inference tensors keep no count
        if self._split is None or self._split_version != version:
            with torch.set_grad_enabled(self._grad_mode):  # the views keep the graph whatever the mode now
                self._split = dict(zip(self._keys, torch.split(values, self._dims, dim=1), strict=True))
            self._split_version = version
        return self._split

    def __getstate__(self) -> dict:
        """Pickled and copied as read: the values, not the function that waits for them."""
        state = dict(self.__dict__, _values=self.values(), _pending=None, _split=None, _split_version=-1)
        return state

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def to_dict(self) -> dict[str, Tensor]:
        """``{feature: [B, D_f]}`` views, as TorchRec's ``KeyedTensor.to_dict``."""
        return {key: self[key] for key in self._keys}

    def length_per_key(self) -> list[int]:
        """``D_f`` of each feature in key order (TorchRec's ``KeyedTensor.length_per_key``)."""
        return list(self._dims)

    def __repr__(self) -> str:
        return f"PooledEmbeddings(keys={self._keys}, dims={self._dims}, batch={self.batch_size})"


@dataclass
class JaggedEmbeddings:
    """Unpooled lookup of one feature: ``values`` [N, D] (one row per id), ``lengths`` [B]."""

    values: Tensor
    lengths: Tensor

    def offsets(self) -> Tensor:
        """``[B + 1]`` start of each sample's rows in ``values``."""
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def to_padded(self, max_length: int | None = None, padding_value: float = 0.0) -> Tensor:
        """``[B, L, D]`` with each sample's rows first and ``padding_value`` after them."""
        batch = self.lengths.numel()
        length = int(self.lengths.max()) if max_length is None and batch else (max_length or 0)
        dim = self.values.shape[1]
        out = self.values.new_full((batch, length, dim), padding_value)
        sample = torch.repeat_interleave(torch.arange(batch, device=self.lengths.device), self.lengths)
        position = torch.arange(self.values.shape[0], device=self.lengths.device) - self.offsets()[sample]
        keep = position < length
        out[sample[keep], position[keep]] = self.values[keep]
        return out
