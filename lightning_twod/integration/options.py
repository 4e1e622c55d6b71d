"""``TwoDOptions``: the 2D options of both strategies, with their defaults, checked once.

``TwoDSparseStrategy`` and ``TwoDSparseFabricStrategy`` take these options as typed keyword
arguments of the same names and defaults (their docstring and ``docs/configuration.md`` say what
each does), build one ``TwoDOptions`` and hand it to the engine, which reads it as plain
attributes, e.g. ``options.sync_interval``. Construction raises ``ValueError`` naming the option
and the fix; the object is frozen, so what was checked is what runs. The strategies' other keyword
arguments go to Lightning's ``DDPStrategy`` and ``DistributedDataParallel``; ``check_extra_arguments``
refuses one that neither takes, where the strategy is made (a typo or TorchRec's name would
otherwise fail only after every process started).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, fields
from numbers import Real
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_twod.cluster.resolve import configured_links
from lightning_twod.core.mesh import PLACEMENTS
from lightning_twod.core.shards import TableChoice, parse_table_choice
from lightning_twod.planner.inputs import FP32_BYTES, SYNC_BYTES, Workload
from lightning_twod.replication import WIRE_DTYPES
from lightning_twod.sparse.kernels import BACKENDS
from lightning_twod.sparse.optimizers import OPTIMIZERS

SYNC_MODES = ("weights", "gradients")
#: ``comm_dtype`` -> the type of the output all-to-all's payload (None: as computed, fp32).
COMM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INIT_SHARDS = ("copy", "in_place")
#: TorchRec's names (``DMPCollection``, ``DistributedModelParallel``, its planner and ``fused_params``)
#: -> what does their work here.
TORCHREC_NAMES = {
    "sharding_group_size": "shard_group_size",
    "use_inter_host_allreduce": "placement ('contiguous' for True, 'strided' for False)",
    "constraints": "sharding (per table a type, e.g. {'item': 'row_wise'})",
    "sharding_types": "sharding (per table a type, e.g. {'item': 'row_wise'})",
    "fused_params": "sparse_optimizer, sparse_lr and sparse_eps",
    "optimizer": "sparse_optimizer",
    "learning_rate": "sparse_lr",
    "eps": "sparse_eps",
    "qcomms_config": "comm_dtype",
    "batch_size": "planner_batch_size",
    "world_size": "the Trainer's num_nodes x devices",
    "device": "the Trainer's accelerator",
}
#: Arguments of ``DistributedDataParallel`` that Lightning passes itself.
_SET_BY_LIGHTNING = ("module", "device_ids")


class OptionError(ValueError):
    """A strategy argument that cannot be used, named with what to use instead (a ``ValueError``)."""


@dataclass(frozen=True)
class TwoDOptions:
    """The 2D options of a strategy (see ``TwoDSparseStrategy`` for each one's meaning).

    Kept in one form: ``sharding`` None becomes ``{}``, ``verify_replicas`` None becomes ``"off"``,
    ``links`` is resolved (a preset name becomes its ``LinkModel``, a file is read now),
    ``sync_overlap`` becomes a bool, and ``sync_mode="gradients"`` sets ``kernel_backend="torch"``.
    """

    shard_group_size: int | Literal["auto"] = "auto"
    placement: Literal["contiguous", "strided", "auto"] = "contiguous"
    sync_interval: int = 1
    sync_mode: Literal["weights", "gradients"] = "weights"
    sync_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    sync_overlap: bool = False
    sparse_optimizer: Literal["rowwise_adagrad", "momentum_rowwise_adagrad", "sgd"] = "momentum_rowwise_adagrad"
    sparse_lr: float = 0.01
    sparse_eps: float = 1e-8
    momentum_scale: float | Literal["auto"] = "auto"
    sharding: dict[str, str | dict[str, Any]] | None = None
    kernel_backend: Literal["auto", "torch", "fbgemm"] = "auto"
    comm_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    init_shards: Literal["copy", "in_place"] = "copy"
    validate_inputs: bool = True
    pipeline: bool = True
    verify_replicas: int | Literal["checkpoint", "off"] | None = "checkpoint"
    memory_per_rank_gb: float | None = None
    plan: str | None = None
    planner_batch_size: int | None = None
    allow_column_wise: bool = False
    links: str | Any = "auto"
    #: Who takes these options, named in every error (the strategy's class name); not stored.
    owner: InitVar[str] = "TwoDOptions"

    def __post_init__(self, owner: str) -> None:
        self._check(owner)
        try:
            links = configured_links(self.links, owner)
        except ValueError as err:
            raise OptionError(str(err)) from None
        # frozen: the one form of each checked value is set here, and only here
        object.__setattr__(self, "sharding", dict(self.sharding or {}))
        object.__setattr__(self, "verify_replicas", "off" if self.verify_replicas is None else self.verify_replicas)
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "sync_overlap", bool(self.sync_overlap))
        if self.sync_mode == "gradients":
            object.__setattr__(self, "kernel_backend", "torch")

    def _check(self, owner: str) -> None:
        """Raise ``OptionError`` naming ``owner``, the first bad option and what to use instead."""
        def fail(text: str) -> None:
            raise OptionError(f"{owner}: {text}")

        group, interval = self.shard_group_size, self.sync_interval
        if group != "auto" and not _positive_int(group):
            fail(f"shard_group_size={group!r}; use a positive int or 'auto'")
        if not _positive_int(interval):
            fail(f"sync_interval={interval!r}; use an int >= 1 (steps between reductions)")
        for name, value, allowed in (("placement", self.placement, (*PLACEMENTS, "auto")),
                                     ("sync_mode", self.sync_mode, SYNC_MODES),
                                     ("sparse_optimizer", self.sparse_optimizer, OPTIMIZERS),
                                     ("kernel_backend", self.kernel_backend, BACKENDS),
                                     ("comm_dtype", self.comm_dtype, tuple(COMM_DTYPES)),
                                     ("sync_dtype", self.sync_dtype, tuple(WIRE_DTYPES)),
                                     ("init_shards", self.init_shards, INIT_SHARDS)):
            if value not in allowed:
                fail(f"{name}={value!r}; use one of {allowed}")
        batch = self.planner_batch_size
        if batch is not None and not _positive_int(batch):
            fail(f"planner_batch_size={batch!r}; use samples per rank (an int >= 1) or None "
                 "(the batch_size of the model or the data)")
        if not isinstance(self.pipeline, bool):
            fail(f"pipeline={self.pipeline!r}; use True or False")
        verify = self.verify_replicas
        if verify not in ("checkpoint", "off", None) and not _positive_int(verify):
            fail(f"verify_replicas={verify!r}; use 'checkpoint' (before every checkpoint and at the end of fit), "
                 "an int N >= 1 (also after every N-th reduction) or 'off'")
        if self.momentum_scale != "auto" and not _positive_number(self.momentum_scale):
            fail(f"momentum_scale={self.momentum_scale!r}; use a number > 0 or 'auto'")
        if self.sync_mode == "gradients" and (self.sync_dtype != "fp32" or self.sync_overlap):
            fail("sync_dtype and sync_overlap shape the weights reduction; "
                 "sync_mode='gradients' averages every step's gradients exactly: drop them")
        if self.sync_mode == "gradients" and self.kernel_backend == "fbgemm":
            fail("sync_mode='gradients' averages gradients before the update, but FBGEMM "
                 "updates rows inside backward; use kernel_backend='torch' or 'auto'")
        for table, entry in (self.sharding or {}).items():
            parse_table_choice(entry, table)
        if not _positive_number(self.sparse_lr):
            fail(f"sparse_lr={self.sparse_lr!r}; the sparse optimizer needs lr > 0")
        if not (_number(self.sparse_eps) and self.sparse_eps >= 0):
            fail(f"sparse_eps={self.sparse_eps!r}; the sparse optimizer needs eps >= 0")
        if self.memory_per_rank_gb is not None and not _positive_number(self.memory_per_rank_gb):
            fail(f"memory_per_rank_gb={self.memory_per_rank_gb!r}; use GiB > 0 or None (the device's share)")

    @property
    def table_choices(self) -> dict[str, TableChoice]:
        """``sharding`` parsed: per table, the type and group size it fixes."""
        return {table: parse_table_choice(entry, table) for table, entry in self.sharding.items()}

    def workload(self, batch_size: int) -> Workload:
        """One training step as the planner predicts it under these options, ``batch_size`` samples per rank."""
        return Workload(batch_size=batch_size, optimizer=self.sparse_optimizer,
                        comm_bytes=FP32_BYTES if self.comm_dtype == "fp32" else 2, sync_mode=self.sync_mode,
                        sync_interval=self.sync_interval, sync_bytes=SYNC_BYTES[self.sync_dtype],
                        sync_overlap=self.sync_overlap, allow_column_wise=self.allow_column_wise)


def check_extra_arguments(owner: str, extra: Mapping[str, Any], host: Callable[..., Any]) -> None:
    """Raise ``OptionError`` unless every keyword argument in ``extra`` is one that ``host`` (the Lightning
    ``DDPStrategy`` that ``owner`` builds on) or ``DistributedDataParallel`` (where ``host`` passes the
    rest) takes. Each other one is named with TorchRec's equivalent here (``TORCHREC_NAMES``) or the
    closest argument ``owner`` takes."""
    ddp = set(_keywords(DistributedDataParallel)) - set(_SET_BY_LIGHTNING)
    accepted = set(_keywords(host)) | ddp
    named = [f.name for f in fields(TwoDOptions)] + sorted(accepted)
    problems = []
    for name, value in extra.items():
        if name in accepted:
            continue
        if name in TORCHREC_NAMES:
            problems.append(f"{name}={value!r} is TorchRec's argument; here it is {TORCHREC_NAMES[name]}")
        elif name in _SET_BY_LIGHTNING:
            problems.append(f"{name}={value!r} is set by Lightning (the LightningModule and the Trainer's devices); "
                            "drop it")
        else:
            close = difflib.get_close_matches(name, named, n=1)
            problems.append(f"unknown argument {name}={value!r} " + (f"(did you mean {close[0]}?)" if close else
                            "(the 2D options are in docs/configuration.md; other keyword arguments go to "
                            f"DistributedDataParallel: {', '.join(sorted(ddp))})"))
    if problems:
        raise OptionError(f"{owner}: " + "; ".join(problems))


def _keywords(function: Callable[..., Any]) -> list[str]:
    """The parameters of ``function`` (a class: of its ``__init__``) that a keyword can give."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds and p.name != "self"]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _positive_number(value: Any) -> bool:
    return _number(value) and value > 0
