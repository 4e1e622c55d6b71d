"""What a reduction puts on the wire: the rows' values in fp32, or their change in bf16 or int8.

``"fp32"``: every copy sends its rows; the sum over the ``M`` copies divided by ``M`` is the mean.

``"bf16"``: every copy sends the change of its rows since the last reduction, ``value - reference``,
rounded to bf16 (half the bytes). The reference is what every copy held after that reduction, so it
is the same on every copy, and the new value ``reference + sum(changes) / M`` is the same on every
copy too. The weights are never rounded: each round adds its rounded mean change in fp32, so a
round's error is of the order of 2^-9 of that round's change, not of the weight (MovieLens-100K:
no measurable quality change, ``docs/quality.md``).

``"int8"``: the change plus what rounding dropped before, in int8 levels of a per-row scale the
copies share (about a quarter of the fp32 bytes; ``quantized``). Each copy keeps a residual
besides the reference.
"""

from __future__ import annotations

import torch

#: Payload types of the cross-group reduction (``TwoDSparseStrategy(sync_dtype=...)``).
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def needs_reference(sync_dtype: str) -> bool:
    """Whether the codec sends changes against a reference copy of the replicated rows."""
    return sync_dtype != "fp32"


def quantized(sync_dtype: str) -> bool:
    """Whether the codec is the int8 one of ``quantized.py`` (per-row scales, residuals)."""
    return sync_dtype == "int8"

