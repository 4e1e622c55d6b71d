"""TorchRec interop of the inputs: ``KeyedJaggedTensor`` <-> ``SparseFeatures``.

A ``KeyedJaggedTensor`` (KJT) is recognised by its methods (``keys()``, ``values()``, ``lengths()``),
so nothing here imports torchrec unless a conversion to its type is asked for; the layouts are the
same (key-major values and lengths), so conversions share the tensors.
"""

from __future__ import annotations

from typing import Any

from lightning_twod.core.features import SparseFeatures


def is_kjt(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``KeyedJaggedTensor`` (has callable keys, values and lengths)."""
    return not isinstance(obj, SparseFeatures) and all(
        callable(getattr(obj, name, None)) for name in ("keys", "values", "lengths"))


def from_kjt(kjt: Any) -> SparseFeatures:
    """A ``SparseFeatures`` over the tensors of ``kjt`` (int64 ids are shared, others converted).

    Raises ``ValueError`` for a variable-batch KJT (a different batch size per key).
    """
    variable = getattr(kjt, "variable_stride_per_key", None)
    if callable(variable) and variable():
        raise ValueError("variable-batch KeyedJaggedTensors (stride per key differs) are not supported; "
                         "give every feature the same batch size")
    keys = list(kjt.keys())
    batch_size = None
    if not keys:
        stride = getattr(kjt, "stride", None)
        batch_size = int(stride()) if callable(stride) else 0
    weights = kjt.weights_or_none() if callable(getattr(kjt, "weights_or_none", None)) else None
    return SparseFeatures(keys, kjt.values(), kjt.lengths(), weights, batch_size=batch_size)


def to_kjt(features: SparseFeatures) -> Any:
    """The ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor`` of ``features`` (shares tensors)."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError as err:
        raise ImportError("SparseFeatures.to_kjt needs TorchRec; install it with `pip install torchrec`") from err
    extra = {} if features.keys else {"stride": features.batch_size}
    return KeyedJaggedTensor(keys=features.keys, values=features.values, lengths=features.lengths,
                             weights=features.weights, **extra)


def as_features(obj: Any, where: str) -> SparseFeatures:
    """``obj`` as ``SparseFeatures``: itself, or converted from a KJT; else a ``TypeError`` naming ``where``."""
    if isinstance(obj, SparseFeatures):
        return obj
    if is_kjt(obj):
        return from_kjt(obj)
    raise TypeError(f"{where} takes SparseFeatures or a TorchRec KeyedJaggedTensor, got {type(obj).__name__}")
