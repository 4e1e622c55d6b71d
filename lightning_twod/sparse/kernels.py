"""Lookup kernels: the local shards of one rank, their lookup and their row update.

A kernel holds ``K`` local shards (``[rows_k, dim_k]`` each) and is called with ``F`` *slots*:
a slot is one feature reading one shard (``slot_shards[f] = k``; shared tables give several
slots per shard). Inputs are laid out slot-major, like ``SparseFeatures``::

    values  [N]       ids (local row numbers of the slot's shard)
    lengths [F * B]   bag lengths: B bags of slot 0, then B bags of slot 1, ...
    weights [N] | None

A pooled kernel returns ``[B, sum(dim of each slot)]`` (sum pooling; mean is applied by the caller,
which knows the bag lengths before sharding); a sequence kernel returns one ``[n_f, dim]`` tensor per
slot. Two backends share this interface:

* ``TorchKernel``: ``torch.nn.functional`` embedding ops with sparse gradients; ``step()`` applies
  the optimizer from ``sparse.optimizers``. The reference, and the GPU path where FBGEMM's CUDA
  wheel is not installed.
* ``FbgemmKernel``: FBGEMM's table-batched embedding (TBE) op with the optimizer fused into its
  backward (``fused = True``: rows are updated during ``loss.backward()``) when that backward is
  the only one through the kernel before the optimizer step; otherwise (several lookups or
  backwards a step, accumulation) the gradients are summed and applied once by ``step()``
  (``update_once``).

Both apply the update once per optimizer step, from the gradient summed over every lookup and
every backward of that step.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_twod.sparse.modules import rows_fp32
from lightning_twod.sparse.optimizers import ADAM_OPTIMIZERS, SparseOptimizerConfig, coalesce_rows, sparse_update
from lightning_twod.sparse.update_once import LookupPart, UpdateGate, UpdateOnceError, behind_gate

__all__ = ["BACKENDS", "FbgemmKernel", "LookupKernel", "ShardShape", "TorchKernel", "UpdateOnceError",
           "fbgemm_available", "fbgemm_optimizer", "fbgemm_refusal", "make_kernel", "nonfinite_mark",
           "resolve_backend"]

BACKENDS = ("auto", "torch", "fbgemm")


@dataclass(frozen=True)
class ShardShape:
    rows: int
    dim: int


@functools.cache
def fbgemm_available() -> bool:
    """Whether FBGEMM's TBE op imports (``fbgemm-gpu-cpu`` or ``fbgemm-gpu`` matching torch)."""
    try:
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    except Exception:  # a torch/FBGEMM mismatch fails with OSError or RuntimeError, not ImportError
        return False
    return True


def nonfinite_mark(values: Tensor) -> Tensor:
    """0-dim fp32: 0 if every element of ``values`` is finite (or there is none), else NaN. One pass
    and no host sync: NaN or inf shows in the smallest or the largest element (``aminmax``, about the
    cost of a sum; ``isfinite`` or an inf-norm take 10-20 times as long on a CPU)."""
    if not values.numel():
        return torch.zeros((), device=values.device)
    return torch.stack(torch.aminmax(values)).float().mul_(0).sum()


class LookupKernel(nn.Module, ABC):
    """Base: shard shapes, slot map and the slot-major input split shared by both backends."""

    fused = False

    def __init__(self, shapes: Sequence[ShardShape], slot_shards: Sequence[int], pooled: bool,
                 optimizer: SparseOptimizerConfig) -> None:
        super().__init__()
        if not shapes:
            raise ValueError("a lookup kernel needs at least one shard")
        self.shapes = list(shapes)
        self.slot_shards = list(slot_shards)
        self.slot_dims = [self.shapes[k].dim for k in self.slot_shards]
        self.pooled = pooled
        self.optimizer = optimizer
        # Called as ``observer(values, lengths)`` at every training lookup (the rows it will update),
        # e.g. by the cross-group reduction to track touched rows; a plain list keeps them out of
        # the module tree.
        self.lookup_observers: list[Callable[[Tensor, Tensor], None]] = []

    def _observe(self, values: Tensor, lengths: Tensor) -> None:
        if self.lookup_observers and self.training and torch.is_grad_enabled():
            for observer in self.lookup_observers:
                observer(values, lengths)

    def device(self) -> torch.device:
        return self.weights()[0].device

    def split_slots(self, values: Tensor, lengths: Tensor, weights: Tensor | None):
        """Per slot ``(ids [n_f], lengths [B], weights [n_f] | None)`` views of slot-major inputs."""
        per_slot_lengths = lengths.view(len(self.slot_shards), -1)
        counts = per_slot_lengths.sum(dim=1).tolist()
        ids = torch.split(values, counts)
        wts = torch.split(weights, counts) if weights is not None else [None] * len(counts)
        return list(zip(ids, per_slot_lengths, wts, strict=True))

    @abstractmethod
    def weights(self) -> list[Tensor]:
        """The shards' weights, ``[rows_k, dim_k]`` each, writable in place."""

    @abstractmethod
    def shard_states(self) -> list[dict[str, Tensor]]:
        """Per shard, its optimizer state by name, as ``optimizer.state_shapes(rows_k, dim_k)`` names and
        shapes them (first dim ``rows_k``; empty for SGD), writable in place."""

    def optimizer_states(self) -> list[Tensor]:
        """Row-wise accumulators ``[rows_k]`` each (empty list for SGD), writable in place: the state of
        the ``optimizers.OPTIMIZERS``. The Adam family keeps more per row: read ``shard_states``."""
        if self.optimizer.name in ADAM_OPTIMIZERS:
            raise ValueError(f"sparse optimizer {self.optimizer.name!r} keeps "
                             f"{list(self.optimizer.state_shapes(0, 0))} per shard, not one row-wise accumulator: "
                             "read them with shard_states()")
        return [states["momentum1"] for states in self.shard_states()] if self.optimizer.has_state else []

    def step(self) -> None:
        """Apply the optimizer to the gradients of the step's backwards (those a fused one applied are done)."""

    @abstractmethod
    def reset_step(self) -> None:
        """Drop what the step's backwards left for ``step()`` (a load, or a step that raised)."""

    @abstractmethod
    def pending_rows(self) -> dict[int, Tensor]:
        """Shard -> the rows ``[u]`` whose gradients wait for ``step()``."""

    def mark_pending(self) -> None:
        """Show the lookup observers again the rows whose gradients wait for ``step()``: a reduction between
        the lookups and the step (a drain for validation or a checkpoint in the middle of an
        accumulation) took their marks, and the step will change them."""
        pending = self.pending_rows()
        if not self.lookup_observers or not pending:
            return
        first = {k: f for f, k in reversed(list(enumerate(self.slot_shards)))}  # a slot reading each shard
        lengths = torch.zeros(len(self.slot_shards), dtype=torch.int64, device=self.device())
        for k, rows in pending.items():
            lengths[first[k]] = rows.numel()
        values = torch.cat([pending[k] for k in sorted(pending, key=first.get)])
        for observer in self.lookup_observers:
            observer(values, lengths)

    @abstractmethod
    def gradient_marks(self) -> Tensor:
        """``[K]`` fp32, no host sync: 0 where the gradients shard ``k`` received since the last ``step()``
        are finite, NaN where some are not (read before ``step()``; FBGEMM marks its fused backwards
        only with ``gate.check_gradients``)."""


class TorchKernel(LookupKernel):
    """Pure torch reference: one parameter per shard, sparse gradients, separate optimizer step.

    The shards' weights (and states) are views of one buffer each, laid end to end in shard order
    as FBGEMM lays out its tables, so that whole-kernel operations (a dense reduction) are one call.

    ``dtype``: the weights' (``torch.float16`` for fp16 tables; the states are fp32 whatever it is). An
    fp16 kernel reads the rows it looks up in fp32 and pools them in fp32, as an fp32 kernel pools; its
    gradients are fp32 row gradients that a gate (``update_once.UpdateGate``, always holding) keeps for
    ``step()``, since autograd would round a gradient to its parameter's dtype.
    """

    def __init__(self, shapes, slot_shards, pooled, optimizer, device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(shapes, slot_shards, pooled, optimizer)
        weights = torch.zeros(sum(s.rows * s.dim for s in self.shapes), device=device, dtype=dtype)
        sizes = [s.rows * s.dim for s in self.shapes]
        widened = dtype != torch.float32
        self.shard_weights = nn.ParameterList(
            nn.Parameter(block.view(s.rows, s.dim), requires_grad=not widened)
            for block, s in zip(weights.split(sizes), self.shapes)
        )
        #: fp16 weights: the fp32 row gradients of the step's lookups, held for ``step()``
        self.gate = None
        if widened:
            self.gate = UpdateGate(pooled, self.slot_shards, self.slot_dims, len(self.shapes), torch.device(device or "cpu"))
            self.gate.defer = True
        # each state laid out like the weights: one buffer a name, a view of it a shard
        per_shard = [optimizer.state_shapes(s.rows, s.dim) for s in self.shapes]
        self.states: list[dict[str, Tensor]] = [{} for _ in self.shapes]
        for name in per_shard[0]:
            sizes = [math.prod(shapes[name]) for shapes in per_shard]
            blocks = torch.zeros(sum(sizes), device=device).split(sizes)
            for states, shapes, block in zip(self.states, per_shard, blocks, strict=True):
                states[name] = block.view(shapes[name])

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor | None):
        self._observe(values, lengths)
        if self.gate is not None:
            return self._widened_forward(values, lengths, weights)
        outs = []
        for slot, (ids, lens, wts) in zip(self.slot_shards, self.split_slots(values, lengths, weights)):
            weight = self.shard_weights[slot]
            if self.pooled:
                offsets = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
                outs.append(F.embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=wts,
                                            include_last_offset=True, sparse=True))
            else:
                rows = F.embedding(ids, weight, sparse=True)
                outs.append(rows if wts is None else rows * wts.unsqueeze(1))
        return torch.cat(outs, dim=1) if self.pooled else outs

    def _widened_forward(self, values: Tensor, lengths: Tensor, weights: Tensor | None):
        """``forward`` of fp16 weights: the rows read in fp32 (``rows_fp32``), pooled as the fp32 kernel
        pools them, the output behind the gate (slot-major ``[B, sum dims]``, or ``[n_f, dim]`` a slot)."""
        training = self.training and torch.is_grad_enabled()
        slots = self.split_slots(values, lengths, weights)
        outs = []
        with torch.no_grad():
            for slot, (ids, lens, wts) in zip(self.slot_shards, slots):
                rows = rows_fp32(self.shard_weights[slot], ids)
                if self.pooled:
                    offsets = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
                    outs.append(F.embedding_bag(torch.arange(ids.numel(), device=ids.device), rows, offsets,
                                                mode="sum", per_sample_weights=wts, include_last_offset=True))
                else:
                    outs.append(rows)
        if self.pooled:
            out = torch.cat(outs, dim=1)
            if training:
                out = behind_gate(out, self.gate, LookupPart(range(len(slots)), values, lengths, weights))
            return out
        if training:
            outs = [behind_gate(rows, self.gate, LookupPart([f], ids, lens, None))
                    for f, (rows, (ids, lens, _)) in enumerate(zip(outs, slots, strict=True))]
        return [rows if wts is None else rows * wts.unsqueeze(1) for rows, (_, _, wts) in zip(outs, slots, strict=True)]

    def weights(self) -> list[Tensor]:
        return [p.data for p in self.shard_weights]

    def shard_states(self) -> list[dict[str, Tensor]]:
        return self.states

    def gradient_marks(self) -> Tensor:
        if self.gate is not None:
            return self.gate.marks()
        marks = [nonfinite_mark(p.grad._values() if p.grad.is_sparse else p.grad) if p.grad is not None
                 else torch.zeros((), device=p.device) for p in self.shard_weights]
        return torch.stack(marks)

    def reset_step(self) -> None:
        if self.gate is not None:
            self.gate.reset()
        for param in self.shard_weights:
            param.grad = None

    def pending_rows(self) -> dict[int, Tensor]:
        if self.gate is not None:
            return self.gate.pending_rows()
        return {k: (p.grad if p.grad.is_sparse else p.grad.to_sparse())._indices()[0]
                for k, p in enumerate(self.shard_weights) if p.grad is not None}

    def sparse_gradients(self) -> list[tuple[Tensor, Tensor] | None]:
        """Per shard the touched rows ``[u]`` and their summed gradients ``[u, dim]`` (fp32), or None."""
        if self.gate is not None:
            summed = self.gate.summed()
            return [summed.get(k) for k in range(len(self.shapes))]
        grads = []
        for param in self.shard_weights:
            if param.grad is None:
                grads.append(None)
                continue
            grad = param.grad.coalesce() if param.grad.is_sparse else param.grad.to_sparse().coalesce()
            grads.append((grad.indices()[0], grad.values()))
        return grads

    def step(self, gradients: Sequence[tuple[Tensor, Tensor] | None] | None = None) -> None:
        """Update rows from ``gradients`` (default: ``sparse_gradients()``), then clear the grads."""
        coalesced = gradients is None  # sparse_gradients() rows are unique already: skip a second unique
        gradients = self.sparse_gradients() if gradients is None else gradients
        for k, grad in enumerate(gradients):
            if grad is None:
                continue
            rows, values = grad if coalesced else coalesce_rows(*grad)
            sparse_update(self.optimizer, self.shard_weights[k].data, self.states[k], rows, values)
        self.reset_step()


class FbgemmKernel(LookupKernel):
    """FBGEMM TBE with the optimizer fused into backward; one op per embedding dim when unpooled.

    A backward is fused (the TBE updates the rows it reads) when it is the only one through this
    kernel's lookups since the last ``step()``; otherwise its row gradients are held and ``step()``
    applies them once (``update_once.UpdateGate``: ``gate.accumulating`` during gradient
    accumulation, ``gate.defer`` under manual optimization).

    ``inputs_checked``: the caller validated every id against its table (the twins do, unless
    ``validate_inputs=False``); the TBE then skips its own bounds check instead of doing it twice.

    ``dtype=torch.float16``: the TBE keeps fp16 weights (``weights_precision=SparseType.FP16``) and fp32
    states, returns fp32 and rounds its fused updates stochastically (its default); the updates ``step()``
    applies round to nearest (``sparse_update``).
    """

    fused = True

    @property
    def inputs_checked(self) -> bool:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

        return all(op.bounds_check_mode_int == BoundsCheckMode.NONE.value for op in self.ops)

    @inputs_checked.setter
    def inputs_checked(self, checked: bool) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

        for op, default in zip(self.ops, self._bounds_check_modes, strict=True):
            op.bounds_check_mode_int = BoundsCheckMode.NONE.value if checked else default

    def __init__(self, shapes, slot_shards, pooled, optimizer, device=None, single_copy: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(shapes, slot_shards, pooled, optimizer)
        self.dtype = dtype
        # FBGEMM's CPU backward finds each table's features by scanning the features in order:
        # any other order gives wrong row-wise AdaGrad updates or an error in backward.
        if any(a > b for a, b in zip(self.slot_shards, self.slot_shards[1:])):
            raise ValueError(
                f"FbgemmKernel needs slot_shards in non-decreasing order (the slots of each shard "
                f"consecutive, shards in order), got {self.slot_shards}; reorder the slots or use "
                "backend='torch'"
            )
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

        device = torch.device(device or "cpu")
        if pooled:
            groups = {None: list(range(len(self.shapes)))}
        else:  # an unpooled TBE needs one embedding dim for all its tables
            groups = {}
            for k, shape in enumerate(self.shapes):
                groups.setdefault(shape.dim, []).append(k)
        self.group_shards = list(groups.values())
        mode = PoolingMode.SUM if pooled else PoolingMode.NONE
        self.ops = nn.ModuleList(self._make_op(shards, mode, device) for shards in self.group_shards)
        self._bounds_check_modes = [op.bounds_check_mode_int for op in self.ops]
        self.gate = UpdateGate(pooled, self.slot_shards, self.slot_dims, len(self.shapes), device,
                               check_gradients=single_copy)  # see make_kernel

    def _make_op(self, shards: list[int], mode, device: torch.device):
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        on_gpu = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
        local = {k: i for i, k in enumerate(shards)}
        return SplitTableBatchedEmbeddingBagsCodegen(
            [(self.shapes[k].rows, self.shapes[k].dim, location, compute) for k in shards],
            feature_table_map=[local[k] for k in self.slot_shards if k in local],
            pooling_mode=mode, weights_precision=SparseType.FP16 if self.dtype == torch.float16 else SparseType.FP32,
            **fbgemm_optimizer(self.optimizer), **({"device": device} if on_gpu else {}),
        )

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor | None):
        self._observe(values, lengths)
        training = self.training and torch.is_grad_enabled()
        self.gate.lookups += training
        if self.pooled:
            offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
            out = self.ops[0](values, offsets, per_sample_weights=weights)
            if training and out.requires_grad:
                out = behind_gate(out, self.gate, LookupPart(range(len(self.slot_shards)), values, lengths, weights))
            return out
        slots = self.split_slots(values, lengths, weights)
        outs: list[Tensor | None] = [None] * len(slots)
        for op, shards in zip(self.ops, self.group_shards, strict=True):
            members = [f for f, k in enumerate(self.slot_shards) if k in shards]
            ids = torch.cat([slots[f][0] for f in members])
            lens = torch.cat([slots[f][1] for f in members])
            offsets = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
            rows = op(ids, offsets)
            if training and rows.requires_grad:
                rows = behind_gate(rows, self.gate, LookupPart(members, ids, lens, None))
            if weights is not None:
                rows = rows * torch.cat([slots[f][2] for f in members]).unsqueeze(1)
            for f, part in zip(members, torch.split(rows, [len(slots[f][0]) for f in members]), strict=True):
                outs[f] = part
        return outs

    def gradient_marks(self) -> Tensor:
        return self.gate.marks()

    def reset_step(self) -> None:
        self.gate.reset()

    def pending_rows(self) -> dict[int, Tensor]:
        return self.gate.pending_rows()

    def step(self) -> None:
        """Apply the gradients held back since the last step, summed per row, once (a fused backward
        applied its own already)."""
        held = self.gate.take()
        if not held:
            return
        weights, states = self.weights(), self.shard_states()
        for k, (rows, grads) in held.items():
            sparse_update(self.optimizer, weights[k], states[k], rows, grads)

    def _per_shard(self, get) -> list:
        found: dict[int, Tensor] = {}
        for op, shards in zip(self.ops, self.group_shards, strict=True):
            found.update(zip(shards, get(op), strict=True))
        return [found[k] for k in range(len(self.shapes))]

    def weights(self) -> list[Tensor]:
        return self._per_shard(lambda op: op.split_embedding_weights())

    def shard_states(self) -> list[dict[str, Tensor]]:
        if not self.optimizer.has_state:
            return [{} for _ in self.shapes]
        names = list(self.optimizer.state_shapes(0, 0))
        return self._per_shard(lambda op: [dict(zip(names, states, strict=True)) for states in op.split_optimizer_states()])


def fbgemm_optimizer(optimizer: SparseOptimizerConfig) -> dict:
    """The arguments of FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` whose fused update equals
    ``sparse_update(optimizer)`` (for a config ``fbgemm_refusal`` lets through): ``EXACT_SGD``,
    ``EXACT_ROWWISE_ADAGRAD`` (momentum-scaled through ``rowwise_lr_eps``), or ``ADAM`` with the row-wise
    bias correction (its states ``momentum1``, ``momentum2``, ``row_counter`` are ``state_shapes``'s) and
    its weight decay, which FBGEMM's Adam kernels always apply decoupled (``"adamw"``)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        OptimType,
        UserEnabledConfigDefinition,
        WeightDecayMode,
    )

    if optimizer.name == "sgd":
        return {"optimizer": OptimType.EXACT_SGD, "learning_rate": optimizer.lr}
    if optimizer.name not in ADAM_OPTIMIZERS:
        lr, eps = optimizer.rowwise_lr_eps()
        return {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": eps}
    return {"optimizer": OptimType.ADAM, "learning_rate": optimizer.lr, "eps": optimizer.eps,
            "beta1": optimizer.beta1, "beta2": optimizer.beta2, "weight_decay": optimizer.weight_decay,
            "weight_decay_mode": WeightDecayMode.DECOUPLE if optimizer.weight_decay else WeightDecayMode.NONE,
            "extra_optimizer_config": UserEnabledConfigDefinition(use_rowwise_bias_correction=True)}


def fbgemm_refusal(optimizer: SparseOptimizerConfig, device=None) -> str | None:
    """Why FBGEMM's fused kernel on ``device`` cannot update rows as ``sparse_update(optimizer)`` does,
    or None where it can (``fbgemm_optimizer``)."""
    name = optimizer.name
    if name == "rowwise_adam" or name == "lamb":
        kind = "PARTIAL_ROWWISE_ADAM" if name == "rowwise_adam" else "LAMB"
        return (f"FBGEMM's {kind} corrects bias with one step count for all rows (the TBE's iter), "
                f"sparse optimizer {name!r} with each row's own")
    if name == "adam" and optimizer.weight_decay:
        return ("FBGEMM's ADAM decays weights decoupled, sparse optimizer 'adam' adds weight_decay * w to the "
                "gradient (L2); 'adamw' is the decoupled form FBGEMM fuses")
    if name in ADAM_OPTIMIZERS and torch.device(device or "cpu").type != "cuda":
        return f"FBGEMM has no CPU kernel for ADAM (sparse optimizer {name!r}), only a CUDA one"
    return None


def resolve_backend(backend: str, shard_dims: Sequence[int], fbgemm_ok: bool | None = None,
                    optimizers: Sequence[SparseOptimizerConfig] = (), device=None) -> tuple[str, str]:
    """``("fbgemm" | "torch", why)`` for kernels of shards whose widths are ``shard_dims``, updated by
    ``optimizers`` on ``device``.

    ``"auto"``: FBGEMM when it imports (``fbgemm_ok``; default: on this process), every width is
    a multiple of 4, as its kernels require, and it fuses every optimizer as ``sparse_update`` runs it
    (``fbgemm_refusal``); else torch. A model's kernels all get one backend, decided from all of its
    shards, so that every rank decides the same.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {BACKENDS}")
    fbgemm_ok = fbgemm_available() if fbgemm_ok is None else fbgemm_ok
    odd = sorted({d for d in shard_dims if d % 4})
    if backend == "fbgemm" and not fbgemm_ok:
        raise RuntimeError(
            "backend='fbgemm' but fbgemm_gpu does not import; install fbgemm-gpu-cpu (CPU) or fbgemm-gpu "
            "(CUDA) built for this torch, or use backend='torch'"
        )
    if backend == "fbgemm" and odd:
        raise ValueError(f"FBGEMM needs embedding dims that are multiples of 4, got shard dims {odd}; "
                         "change the dims or the column-wise split, or use backend='torch'")
    refusal = next(filter(None, (fbgemm_refusal(optimizer, device) for optimizer in optimizers)), None)
    if backend == "fbgemm" and refusal:
        raise ValueError(f"backend='fbgemm' but {refusal}; use backend='torch' (or 'auto')")
    if backend == "torch":
        return "torch", "asked for"
    if backend == "fbgemm":
        return "fbgemm", "asked for"
    if not fbgemm_ok:
        return "torch", "auto: fbgemm_gpu does not import"
    if odd:
        return "torch", f"auto: FBGEMM needs shard widths that are multiples of 4, and some are {odd}"
    if refusal:
        return "torch", f"auto: {refusal}"
    return "fbgemm", "auto: FBGEMM imports and every shard width is a multiple of 4"


def make_kernel(backend: str, shapes: Sequence[ShardShape], slot_shards: Sequence[int], pooled: bool,
                optimizer: SparseOptimizerConfig, device=None, *, single_copy: bool = False,
                dtype: torch.dtype = torch.float32) -> LookupKernel:
    """A kernel on ``backend`` (``"fbgemm"``, ``"torch"``, or ``"auto"``: see ``resolve_backend``);
    ``single_copy``: its shards have no copy that a reduction round would check, so FBGEMM marks the
    gradients of its fused backwards too (``gradient_marks``); ``dtype``: its weights' (fp32 or fp16)."""
    name, _ = resolve_backend(backend, [s.dim for s in shapes], optimizers=[optimizer], device=device)
    if name == "fbgemm":
        return FbgemmKernel(shapes, slot_shards, pooled, optimizer, device, single_copy=single_copy, dtype=dtype)
    return TorchKernel(shapes, slot_shards, pooled, optimizer, device, dtype=dtype)
