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

The rows of an fp16 table (``EmbeddingTableConfig(dtype="fp16")``) go in a round of their own on every
wire, as they are: fp16 on the wire, summed in fp16 over the copies, the mean written back (``rows_dtype``).
That is the fp32 wire's arithmetic on rows that are fp16 already, with no fp32 round trip: half the
bytes, as many as the bf16 wire's changes, and every copy ends with the same fp16 row after every round
that waits. Sent as changes on the bf16 or int8 wire, a row would be rounded twice (the change, then the
new value to fp16), and the copies' fp16 residuals would be kept nowhere. Their optimizer state is fp32
and goes as an fp32 table's does.
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



def rows_dtype(sync_dtype: str, rows: torch.dtype) -> torch.dtype:
    """The dtype a round puts on the wire for tensors of dtype ``rows``: the fp32 wire sends them as they
    are (an fp16 table's rows as fp16), the others their changes in ``WIRE_DTYPES[sync_dtype]``."""
    return rows if sync_dtype == "fp32" else WIRE_DTYPES[sync_dtype]
