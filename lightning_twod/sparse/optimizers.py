"""Sparse optimizers for embedding rows: SGD, row-wise AdaGrad and its momentum-scaled form, and the
Adam family (Adam, AdamW, TorchRec's partial row-wise Adam, LAMB).

Row-wise AdaGrad keeps one accumulator per row (not per element)::

    v[row] += mean(g[row] ** 2)                       # over the row's D columns
    w[row] -= lr * g[row] / (sqrt(v[row] / c) + eps)  # c = momentum scale; c = 1 is plain AdaGrad

The layout makes a row's accumulator grow ``c`` times faster than in 1D training
(``layout_momentum_scale``): ``M`` for sharded tables, ``W`` for data-parallel tables, 1 when the
replicas average gradients; dividing by that ``c`` undoes it. Since
``lr * g / (sqrt(v / c) + eps) == (lr * sqrt(c)) * g / (sqrt(v) + eps * sqrt(c))`` the scaled form
runs on any plain row-wise AdaGrad kernel (FBGEMM's included) with ``lr`` and ``eps`` rescaled.

The Adam family (``ADAM_OPTIMIZERS``) keeps, per row, a first moment ``momentum1 [rows, dim]``, a
second moment ``momentum2`` (``[rows, dim]``; ``[rows]`` for ``rowwise_adam``) and a step count
``step [rows]`` (``SparseOptimizerConfig.state_shapes``)::

    g  = g + weight_decay * w                     # "adam", "rowwise_adam" only: L2, as torch.optim.Adam
    t  = step[row] += 1
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g ** 2         # "rowwise_adam": mean(g ** 2) over the row, one per row
    u  = (m / (1 - beta1 ** t)) / (sqrt(v / (1 - beta2 ** t)) + eps)
    w -= lr * u                                   # "adam", "rowwise_adam"
    w -= lr * (u + weight_decay * w)              # "adamw": decoupled, as torch.optim.AdamW
    w -= lr * (|w| / |r|) * r,  r = u + weight_decay * w    # "lamb", each row a layer

Rows are updated lazily, as ``torch.optim.SparseAdam`` does: only on the steps whose gradient touches
them, and their bias correction uses ``step[row]``, the number of steps that touched the row. A row
then follows exactly ``torch.optim.Adam`` (or AdamW, or LAMB) run on that row alone over the steps it
was touched; with a global step count instead, a row first touched at step 1000 would get no bias
correction at all (``1 - beta ** 1000 ~ 1``) and its first update would be ``(1 - beta1) / sqrt(1 -
beta2)``, about 3.2, times the corrected one. FBGEMM does the same for ``ADAM`` only when asked
(``UserEnabledConfigDefinition(use_rowwise_bias_correction=True)``: a ``row_counter`` incremented where
the row is updated, fbgemm_gpu/codegen/genscript/optimizers.py ``adam()``); by default, and always for
``PARTIAL_ROWWISE_ADAM``, ``LAMB`` and ``PARTIAL_ROWWISE_LAMB``, its correction uses the TBE's global
``iter``, counted once per training forward of the op (``iter_int = int(self.iter_cpu.add_(1).item())``
in split_table_batched_embeddings_ops_training.py). ``step`` is fp32, as FBGEMM's ``row_counter``:
replicas average it with the rest of the state, so it need not stay whole (exact up to 2**24 touches,
past which ``beta ** t`` is 0 in fp32 anyway).

LAMB (You et al., arXiv 1904.00962, with bias correction) rather than its partial row-wise form: it is
the paper's algorithm, so its reference is written from the paper, and its state has Adam's shapes.
Its trust ratio is 1 where a row's ``|w|`` or ``|r|`` is 0, as NVIDIA's apex takes it (FBGEMM divides
as it is: a zero row never moves).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

OPTIMIZERS = ("sgd", "rowwise_adagrad", "momentum_rowwise_adagrad")
"""The optimizers whose state is at most one row-wise accumulator ``[rows]`` (``LookupKernel.optimizer_states``)."""
ADAM_OPTIMIZERS = ("adam", "adamw", "rowwise_adam", "lamb")
"""The Adam family: moments and a step count per row (``SparseOptimizerConfig.state_shapes``)."""


@dataclass(frozen=True)
class SparseOptimizerConfig:
    """How embedding rows are updated; one config per sharded collection."""

    name: str = "momentum_rowwise_adagrad"
    """``"sgd"``, ``"rowwise_adagrad"`` or ``"momentum_rowwise_adagrad"`` (the strategies' default;
    with the default ``momentum_scale`` of 1 it is exactly ``"rowwise_adagrad"``), or one of
    ``ADAM_OPTIMIZERS``."""
    lr: float = 0.01
    eps: float = 1e-8
    momentum_scale: float = 1.0
    """Accumulator divisor ``c``; used by ``"momentum_rowwise_adagrad"`` only."""
    beta1: float = 0.9
    """The Adam family's first-moment decay (``torch.optim.Adam``'s ``betas[0]``; FBGEMM's name)."""
    beta2: float = 0.999
    """The Adam family's second-moment decay (``betas[1]``)."""
    weight_decay: float = 0.0
    """The Adam family only, in the form its name says: L2 added to the gradient (``"adam"``,
    ``"rowwise_adam"``), decoupled (``"adamw"``) or inside LAMB's trust ratio (``"lamb"``)."""

    def __post_init__(self) -> None:
        names = (*OPTIMIZERS, *ADAM_OPTIMIZERS)
        if self.name not in names:
            raise ValueError(f"unknown sparse optimizer {self.name!r}; use one of {names}")
        if not self.lr > 0 or not self.eps >= 0:
            raise ValueError(f"sparse optimizer needs lr > 0 and eps >= 0, got lr={self.lr}, eps={self.eps}")
        if not self.momentum_scale > 0:
            raise ValueError(f"momentum_scale must be > 0, got {self.momentum_scale}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"sparse optimizer {self.name!r} needs 0 <= beta1 < 1 and 0 <= beta2 < 1, "
                             f"got beta1={self.beta1}, beta2={self.beta2}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.weight_decay and self.name not in ADAM_OPTIMIZERS:
            raise ValueError(f"sparse optimizer {self.name!r} has no weight decay, got weight_decay={self.weight_decay}; "
                             f"set it to 0 or use one of {ADAM_OPTIMIZERS}")

    @property
    def has_state(self) -> bool:
        """Whether any state is kept per row (``state_shapes`` is not empty)."""
        return self.name != "sgd"

    def state_shapes(self, rows: int, dim: int) -> dict[str, tuple[int, ...]]:
        """The state of a ``[rows, dim]`` shard: name -> shape, first dim ``rows``, in a fixed order
        (FBGEMM's ``split_optimizer_states`` order and names; row-wise AdaGrad's accumulator is its
        ``momentum1``)."""
        if self.name == "sgd":
            return {}
        if self.name in OPTIMIZERS:
            return {"momentum1": (rows,)}
        second = (rows,) if self.name == "rowwise_adam" else (rows, dim)
        return {"momentum1": (rows, dim), "momentum2": second, "step": (rows,)}

    @property
    def exact_states(self) -> tuple[str, ...]:
        """The states a replica round sends in fp32 whatever its wire (``sync_dtype``): the Adam family's
        ``step``, a count that bf16 holds exactly only up to 256, and its second moment ``momentum2``, which
        must stay >= 0. A bf16 or int8 wire sends each copy's change since the last round, rounded; ``v``
        decays, so its change is negative, and where it nears ``-v`` (a row whose gradients vanished over
        the interval, a small ``beta2``) rounding can take it past ``-v`` (``v = 1.005``, change ``-1.005``:
        bf16 rounds it to ``-1.0078``; int8 rounds by up to half a level of the row's scale), which leaves
        ``v < 0`` and ``sqrt(v)`` NaN. The weights, the first moment ``m`` (signed, of the size of the
        gradients, like the weights' changes) and row-wise AdaGrad's accumulator (it only grows: its change
        is >= 0) go on the wire."""
        return ("momentum2", "step") if self.name in ADAM_OPTIMIZERS else ()

    @property
    def accumulator_scale(self) -> float:
        """``c``: the step divides the accumulator by it (1 unless ``momentum_rowwise_adagrad``)."""
        return self.momentum_scale if self.name == "momentum_rowwise_adagrad" else 1.0

    def rowwise_lr_eps(self) -> tuple[float, float]:
        """``(lr, eps)`` of the plain row-wise AdaGrad that equals this config."""
        scale = self.accumulator_scale
        return self.lr * math.sqrt(scale), self.eps * math.sqrt(scale)


def layout_momentum_scale(data_parallel: bool, world_size: int, shard_group_size: int, sync_mode: str) -> float:
    """The factor ``c`` by which a layout makes a row's accumulator grow faster than in 1D training.

    1D's gradient of a row is the mean over all ``W`` ranks' local-batch gradients. A sharded table's
    copy takes the mean over its ``S`` ranks (the output dist's ``1 / S``), so a row that only one
    replica group saw gets ``M = W / S`` times the 1D gradient, ``M**2`` times its square, and the
    accumulator averaged over the ``M`` copies grows ``M`` times faster. A data-parallel table's copy
    takes its own rank's gradient, ``W`` times the 1D one, and its copies are averaged over ``W``:
    ``W`` times faster. With ``sync_mode="gradients"`` the copies apply the averaged gradient, which
    is the 1D gradient: ``c = 1``.

    The Adam family takes no ``c`` (``accumulator_scale`` is 1). Its ``m`` and ``v`` are EMAs of ``g``
    and ``g**2``: the copy that saw ``M`` times the 1D gradient takes ``M`` times the gradient into
    ``m`` and ``M**2`` times its square into ``v``. Averaged over the copies (a row one copy read a
    step), ``step`` grows ``1 / M`` a step, ``v`` tends to ``M**2`` times 1D's, ``m`` to between 1D's
    (gradients of varying sign) and ``M`` times it (of one sign), and the mean of the weights takes
    ``1 / M`` of the copy's move; a row every copy read gets 1D's means. A divisor of ``v`` would scale
    every row's step by ``sqrt(c)``, right for neither kind of row (``concepts.md``, with measurements).
    """
    if sync_mode == "gradients":
        return 1.0
    return float(world_size if data_parallel else world_size // shard_group_size)


def layout_optimizer(name: str, lr: float, eps: float, momentum_scale: float | str, *, data_parallel: bool,
                     world_size: int, shard_group_size: int, sync_mode: str, betas: tuple[float, float] = (0.9, 0.999),
                     weight_decay: float = 0.0) -> SparseOptimizerConfig:
    """The config of one kind of table on one layout; ``momentum_scale="auto"``: ``layout_momentum_scale``.

    A number is used as it is, for every kind of table. ``betas`` and ``weight_decay``: the Adam family's.
    """
    scale = (layout_momentum_scale(data_parallel, world_size, shard_group_size, sync_mode)
             if momentum_scale == "auto" else float(momentum_scale))
    return SparseOptimizerConfig(name, lr, eps, scale, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay)


def coalesce_rows(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Sum gradient rows that hit the same row: ``rows`` [n], ``grads`` [n, D] -> unique [u], [u, D]."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = grads.new_zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    return unique, summed


@torch.no_grad()
def sparse_update(
    config: SparseOptimizerConfig, weight: Tensor, state: Mapping[str, Tensor] | Tensor | None, rows: Tensor,
    grads: Tensor
) -> None:
    """Apply one step in place to the given rows.

    ``weight`` [R, D]; ``state`` the shard's ``config.state_shapes`` tensors by name (None or empty for
    SGD; row-wise AdaGrad's accumulator [R] may also come alone); ``rows`` [u] unique row ids;
    ``grads`` [u, D] their summed gradients.

    An fp16 ``weight`` (an ``EmbeddingTableConfig(dtype="fp16")`` table) is updated in fp32: its rows are
    widened (exactly), updated with the fp32 state and the fp32 gradients as an fp32 table's rows are, and
    written back rounded to nearest; the state stays fp32. The result is an fp32 table's update followed by
    rounding the touched rows to fp16. (FBGEMM's fused fp16 update rounds stochastically instead.)
    """
    if rows.numel() == 0:
        return
    if isinstance(state, Tensor):
        if config.name in ADAM_OPTIMIZERS:
            raise ValueError(f"sparse optimizer {config.name!r} keeps {list(config.state_shapes(*weight.shape))} "
                             "per row: pass them as a mapping by name, not one accumulator")
        state = {"momentum1": state}
    if weight.dtype != torch.float32:
        _update_widened(config, weight, state or {}, rows, grads)
        return
    grads = grads.to(weight.dtype)
    if config.name == "sgd":
        weight.index_add_(0, rows, grads, alpha=-config.lr)
        return
    assert state, f"sparse optimizer {config.name!r} needs its state"
    if config.name in ADAM_OPTIMIZERS:
        _adam_family_update(config, weight, state, rows, grads)
        return
    accumulated = state["momentum1"][rows] + grads.pow(2).mean(dim=1)
    state["momentum1"][rows] = accumulated
    step = config.lr / ((accumulated / config.accumulator_scale).sqrt() + config.eps)
    weight.index_add_(0, rows, grads * step.unsqueeze(1), alpha=-1.0)


def _update_widened(config: SparseOptimizerConfig, weight: Tensor, state: Mapping[str, Tensor], rows: Tensor,
                    grads: Tensor) -> None:
    """``sparse_update`` of a low-precision ``weight`` [R, D]: its ``rows`` [u] and their state in fp32,
    updated there, the rows written back rounded to nearest (``Tensor.to``)."""
    master = weight[rows].float()  # [u, D]
    local = torch.arange(rows.numel(), device=rows.device)
    gathered = {name: tensor[rows] for name, tensor in state.items()}
    sparse_update(config, master, gathered, local, grads)
    weight[rows] = master.to(weight.dtype)
    for name, tensor in gathered.items():
        state[name][rows] = tensor


def _adam_family_update(config: SparseOptimizerConfig, weight: Tensor, state: Mapping[str, Tensor], rows: Tensor,
                        grads: Tensor) -> None:
    """One step of an ``ADAM_OPTIMIZERS`` member on ``rows`` [u] (unique) with ``grads`` [u, D] (the
    module docstring's formulas, written as ``torch.optim.Adam`` writes them)."""
    w = weight[rows]
    if config.name in ("adam", "rowwise_adam"):
        grads = grads.add(w, alpha=config.weight_decay)
    step = state["step"][rows] + 1
    m = state["momentum1"][rows].lerp_(grads, 1 - config.beta1)
    v = state["momentum2"][rows].mul_(config.beta2)
    if config.name == "rowwise_adam":
        v.add_(grads.square().mean(dim=1), alpha=1 - config.beta2)
    else:
        v.addcmul_(grads, grads, value=1 - config.beta2)
    state["step"][rows], state["momentum1"][rows], state["momentum2"][rows] = step, m, v
    # bias corrections [u, 1], in fp64 as torch.optim.Adam takes them (Python floats)
    correction1 = (1 - config.beta1 ** step.double()).unsqueeze(1)
    correction2 = (1 - config.beta2 ** step.double()).unsqueeze(1)
    second = v if v.dim() == 2 else v.unsqueeze(1)  # [u, D], or [u, 1] for one second moment a row
    update = m / (second.sqrt() / correction2.sqrt().to(v.dtype) + config.eps) / correction1.to(m.dtype)
    if config.name == "adamw":
        w.mul_(1 - config.lr * config.weight_decay)
    elif config.name == "lamb":
        update.add_(w, alpha=config.weight_decay)
        w_norm, update_norm = w.norm(dim=1, keepdim=True), update.norm(dim=1, keepdim=True)
        update.mul_(torch.where((w_norm > 0) & (update_norm > 0), w_norm / update_norm, 1.0))
    weight[rows] = w.sub_(update, alpha=config.lr)
