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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


class PooledEmbeddings(Mapping[str, Tensor]):
    """Per-feature pooled vectors sharing one ``[B, sum(D_f)]`` buffer, in feature order."""

    def __init__(self, keys: Sequence[str], dims: Sequence[int], values: Tensor) -> None:
        if values.dim() != 2 or values.shape[1] != sum(dims):
            raise ValueError(
                f"values must be [B, {sum(dims)}] for dims {list(dims)}, got {list(values.shape)}"
            )
        self._keys = list(keys)
        self._dims = list(dims)
        self._values = values
        starts = [0]
        for dim in self._dims:
            starts.append(starts[-1] + dim)
        self._start = dict(zip(self._keys, starts, strict=False))
        self._dim = dict(zip(self._keys, self._dims, strict=True))

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self._keys)

    @property
    def dims(self) -> list[int]:
        """Embedding dimension of each feature, in key order."""
        return list(self._dims)

    def values(self) -> Tensor:  # type: ignore[override]
        """All features concatenated in key order: ``[B, sum(D_f)]``."""
        return self._values

    def __getitem__(self, key: str) -> Tensor:
        """``[B, D_key]`` view of the shared buffer."""
        start = self._start[key]
        return self._values.narrow(1, start, self._dim[key])

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
        return f"PooledEmbeddings(keys={self._keys}, dims={self._dims}, batch={self._values.shape[0]})"


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
