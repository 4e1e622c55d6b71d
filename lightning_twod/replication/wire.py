"""What a reduction puts on the wire: the rows' values in fp32, or their change in bf16.

``"fp32"``: every copy sends its rows; the sum over the ``M`` copies divided by ``M`` is the mean.

``"bf16"``: every copy sends the change of its rows since the last reduction, ``value - reference``,
rounded to bf16 (half the bytes). The reference is what every copy held after that reduction, so it
is the same on every copy, and the new value ``reference + sum(changes) / M`` is the same on every
copy too. Rounding touches only the change of one interval, never the weights themselves, so it
does not accumulate over rounds.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Payload types of the cross-group reduction (``TwoDSparseStrategy(sync_dtype=...)``).
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def needs_reference(sync_dtype: str) -> bool:
    """Whether the codec sends changes against a reference copy of the replicated rows."""
    return sync_dtype != "fp32"


def encode(values: Tensor, reference: Tensor | None, sync_dtype: str) -> Tensor:
    """The buffer to sum over the group: ``values`` [n] fp32 (and their ``reference`` [n])."""
    if sync_dtype == "fp32":
        return values.clone()
    return (values - reference).to(WIRE_DTYPES[sync_dtype])


def decode(summed: Tensor, reference: Tensor | None, copies: int, sync_dtype: str) -> Tensor:
    """The mean over ``copies`` copies, fp32 [n], from the summed buffer."""
    if sync_dtype == "fp32":
        return summed / copies
    return reference + summed.float() / copies
