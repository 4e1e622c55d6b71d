"""``TwoDOptions``: the 2D options of both strategies, with their defaults and documentation, checked once.

Each option is documented where it is defined: the string right below its ``TwoDOptions`` field.
The strategies' docstrings (``strategy_docstring``) and the options table of
``docs/configuration.md`` are made from those strings (``python -m lightning_twod.strategies.options``
rewrites the table; ``tests/unit/test_options.py`` checks it is current).

``TwoDSparseStrategy`` and ``TwoDSparseFabricStrategy`` take these options as typed keyword
arguments of the same names and defaults (LightningCLI reads their signatures), and both call
``build_options``, which hands one ``TwoDOptions`` to the engine; the engine reads it as plain
attributes, e.g. ``options.sync_interval``. Construction raises ``ValueError`` naming the option
and the fix; the object is frozen, so what was checked is what runs. The strategies' other keyword
arguments go to Lightning's ``DDPStrategy`` and ``DistributedDataParallel``; ``check_extra_arguments``
refuses one that neither takes, where the strategy is made (a typo or TorchRec's name would
otherwise fail only after every process started).
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, fields
from numbers import Real
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_twod.core.mesh import AUTO_GROUP_SIZE, PLACEMENTS
from lightning_twod.core.shards import ShardingType, TableChoice, parse_table_choice
from lightning_twod.hardware.resolve import configured_links
from lightning_twod.planner.inputs import FP32_BYTES, ROW_NORM_OPTIMIZERS, SYNC_BYTES, Workload, column_wise_refusal
from lightning_twod.planner.lookup_stats import STAT_FIELDS, check_lookup_stats
from lightning_twod.replication import WIRE_DTYPES
from lightning_twod.sparse.kernels import BACKENDS
from lightning_twod.sparse.optimizers import ADAM_OPTIMIZERS, OPTIMIZERS
from lightning_twod.sparse.table_optimizers import OptimizerSettings, table_settings

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
    "fused_params": "sparse_optimizer, sparse_lr and sparse_eps (per table: sparse_per_table)",
    "optimizer": "sparse_optimizer",
    "learning_rate": "sparse_lr",
    "eps": "sparse_eps",
    "beta1": "sparse_betas",
    "beta2": "sparse_betas",
    "weight_decay": "sparse_weight_decay",
    "qcomms_config": "comm_dtype",
    "batch_size": "planner_batch_size",
    "world_size": "the Trainer's num_nodes x devices",
    "device": "the Trainer's accelerator",
}
#: Arguments of ``DistributedDataParallel`` that Lightning passes itself.
_SET_BY_LIGHTNING = ("module", "device_ids")
#: The strategies' arguments that are not 2D options (they go to Lightning's ``DDPStrategy``): default, meaning.
HOST_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "process_group_backend": (None, '``"gloo"`` on CPU, ``"nccl"`` on CUDA by default.'),
    "timeout": (1800.0, "Seconds a collective may wait before the process group fails (a dead rank then stops "
                        "the others instead of hanging them)."),
    "start_method": ("popen", '``"popen"``: Lightning\'s subprocess launcher (also under torchrun and SLURM); '
                              '``"spawn"``; ``"fork"`` (notebooks). The registered names ``twod_sparse_spawn`` and '
                              "``twod_sparse_notebook`` select spawn and fork."),
}
#: The page whose options table ``write_configuration_table`` makes, and the lines around that table.
CONFIGURATION_PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
TABLE_START = ("<!-- options table: made from the TwoDOptions fields by "
               "`python -m lightning_twod.strategies.options`; edit the fields, not the rows -->")
TABLE_END = "<!-- end of the options table -->"


class OptionError(ValueError):
    """A strategy argument that cannot be used, named with what to use instead (a ``ValueError``)."""


@dataclass(frozen=True)
class TwoDOptions:
    """The 2D options of a strategy; the string below each field is its documentation (``option_docs``).

    Kept in one form: ``sharding`` None becomes ``{}``, ``verify_replicas`` None becomes ``"off"``,
    ``links`` is resolved (a preset name becomes its ``LinkModel``, a file is read now),
    ``sync_overlap`` becomes a bool, ``sparse_betas`` a tuple of floats, a ``lookup_stats`` mapping becomes a
    dict of dicts, and ``sync_mode="gradients"`` sets ``kernel_backend="torch"``.
    """

    shard_group_size: int | Literal["auto"] = AUTO_GROUP_SIZE
    """Ranks per shard group of the tables that have no group size of their own (``sharding``). Must divide
    the world size. ``world_size``: 1D (full) sharding. ``"auto"``: first the best global layout (every table
    in groups of one size): among the group sizes (every divisor of the world size) whose busiest rank fits in
    memory, the one with the lowest predicted step time for this run's ``sync_interval``, ``sync_overlap``,
    ``sync_dtype``, ``comm_dtype``, ``planner_batch_size`` and tables, on ``links`` (see ``docs/planner.md``);
    then each table its own group size where that is predicted faster (a search from that layout: every
    assignment where there are at most 256, else greedy, table by table, largest first, at most 3 passes;
    ``docs/planner.md``). Measured links are three probes; a layout listed later (larger groups, then strided)
    is chosen over an earlier one, and a per-table assignment over the global layout, when it is predicted
    faster on every probe and their fastest numbers, or by at least 10 % on the fastest numbers;
    set-ups on the same hosts read the same links from the links cache (``links``), so one config on one
    cluster gets one layout, and ``lightning-twod plan`` on the same machine prints it. The log lists every
    candidate with its predicted milliseconds per phase, its range over the probes and memory, why the winner
    won, the candidates close to it, and per table its type, group size and the predicted step with it in
    groups of each other size."""
    placement: Literal["contiguous", "strided", "auto"] = "contiguous"
    """``"contiguous"``: a shard group is consecutive ranks (one node, local all-to-all). ``"strided"``: a
    replica group is consecutive ranks (TorchRec's 2D layout; the reduction stays local). ``"auto"``: the one
    with the lower predicted step time, chosen together with the group size."""
    sync_interval: int = 1
    """Optimizer steps between cross-group reductions (``sync_mode="weights"``). Larger: less traffic across
    groups, replicas drift apart in between. Validation, test, predict, every checkpoint, every read of the
    tables (the model's ``state_dict()``, ``full_table``) and the end of fit first complete a reduction (so
    they see identical copies); the interval restarts there."""
    sync_mode: Literal["weights", "gradients"] = "weights"
    """``"weights"``: average touched rows' weights and optimizer state over the replica group every
    ``sync_interval`` steps. ``"gradients"``: average touched rows' gradients before every update (exactly 1D
    training; uses the torch kernels)."""
    sync_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """Payload of the cross-group reduction: ``"fp32"`` rows, or ``"bf16"``: each copy's change since the last
    reduction (half the bytes; the copies stay bit-identical; one reference copy of the replicated shards'
    weights and state in memory), or ``"int8"``: that change plus this copy's residual (what rounding dropped
    before) in int8 levels of a per-row scale the copies share (about a quarter of the fp32 bytes; a reference
    and a residual copy in memory; at most 127 copies; the residuals are not checkpointed: every drain after
    an int8 round (validation, a checkpoint, the end of fit, a read of the tables) adds the copies' mean
    residual to the weights in fp32 and zeroes them, so a resume equals the run that saved, bit for bit,
    ``checkpoints.md``). On fast links the conversions can cost more than the bytes saved
    (``benchmarks/results/scaling.md``). Quality of both against fp32: ``quality.md``."""
    sync_overlap: bool = False
    """Launch each reduction in the background when due and apply it when the next is due (``sync_interval``
    steps later), as ``w <- (w - w_launch) + mean`` (exactly the mean where the row did not change meanwhile);
    on the bf16 wire as ``w <- w + (mean change - sent change)``, which touches each row once and leaves each
    copy what rounding kept of its change off the wire until a later round sends it (``concepts.md``).
    Its transfer hides under the training of the interval; the copies are bit-identical after every drain
    (validation, checkpoints, end of fit). On CPU ranks (gloo) the transfer's summing and TCP run on the cores
    that train, so it hides only where the link is slow (1 Gbit/s on the testbed) and costs time where it is
    fast (``benchmarks/results/scaling.md``)."""
    sparse_optimizer: Literal["rowwise_adagrad", "momentum_rowwise_adagrad", "sgd", "adam", "adamw", "rowwise_adam",
                              "lamb"] = "momentum_rowwise_adagrad"
    """``"momentum_rowwise_adagrad"`` (the method: row-wise AdaGrad whose accumulator is divided by
    ``momentum_scale``; with one replica group it is exactly row-wise AdaGrad), ``"rowwise_adagrad"`` (plain;
    loses parity with 1D from 4 replica groups on, ``quality.md``), ``"sgd"``, or the Adam family: ``"adam"``,
    ``"adamw"`` (decoupled weight decay), ``"rowwise_adam"`` (TorchRec's partial row-wise Adam: one second
    moment a row) and ``"lamb"``, each row's bias corrected by the steps that touched it (``configuration.md``
    lists what each supports). Applies to embedding rows only; dense parameters use the optimizer of
    ``configure_optimizers``."""
    sparse_lr: float = 0.01
    """Learning rate of the embedding rows."""
    sparse_eps: float = 1e-8
    """Epsilon of AdaGrad and of the Adam family."""
    sparse_betas: tuple[float, float] = (0.9, 0.999)
    """The Adam family's ``(beta1, beta2)``: decays of the first and second moments, as ``torch.optim.Adam``'s
    ``betas``."""
    sparse_weight_decay: float = 0.0
    """The Adam family's weight decay: L2 added to the gradient (``adam``, ``rowwise_adam``), decoupled
    (``adamw``) or inside LAMB's trust ratio (``lamb``); must be 0 for the other optimizers."""
    momentum_scale: float | Literal["auto"] = "auto"
    """Accumulator divisor ``c`` of ``momentum_rowwise_adagrad``. ``"auto"``: the factor by which the layout
    makes a row's accumulator grow faster than in 1D (``concepts.md``): ``M`` (replica groups) for sharded
    tables (a table in groups of its own size: its own ``W / S_t``), ``W`` (world size) for data-parallel
    tables, 1 with ``sync_mode="gradients"``. A number is used as it is for every table."""
    sparse_per_table: dict[str, dict[str, Any]] | None = None
    """Per table, sparse optimizer settings of its own, as TorchRec's per-table fused parameters: ``{"t_big":
    {"optimizer": "rowwise_adam", "lr": 0.001}, "t_small": {"lr": 0.1}}``. Keys: ``optimizer``, ``lr``, ``eps``,
    ``betas``, ``weight_decay``, ``momentum_scale`` (the options above without their ``sparse_`` prefix); a key
    left out is the strategy's. Tables whose settings differ train in kernels of their own (each with its own
    lookup all-to-alls: one more round of them a step per distinct setting). In YAML: ``sparse_per_table:
    {t_big: {optimizer: rowwise_adam, lr: 0.001}}``."""
    sharding: dict[str, str | dict[str, Any]] | None = None
    """Per table, its sharding type, its own shard group size, or both: ``{"item": {"type": "row_wise",
    "shard_group_size": 8}, "user": "row_wise", "country": "data_parallel"}``. Types: ``table_wise``,
    ``row_wise``, ``column_wise``, ``data_parallel``. A table's own group size ``S_t`` (a divisor of the world
    size) shards it over groups of ``S_t`` ranks with ``W / S_t`` copies, kept in step over its own replica
    groups (``momentum_scale="auto"``: ``c = W / S_t``); ``S_t = W`` is 1D for that table. The group sizes
    share one ``placement``. Tables without an entry are placed by the planner, balancing predicted lookup and
    communication time per rank within memory. Plain ``nn.EmbeddingBag``/``nn.Embedding`` attributes are named
    by their attribute path. In YAML: ``sharding: {item: {type: row_wise, shard_group_size: 8}, country:
    data_parallel}``."""
    kernel_backend: Literal["auto", "torch", "fbgemm"] = "auto"
    """``"auto"``, ``"torch"`` or ``"fbgemm"``: one backend for all kernels, the same on every rank.
    ``"auto"``: FBGEMM when it imports on every rank, every shard width is a multiple of 4 and it fuses the
    sparse optimizer on this device as the torch kernel runs it (of the Adam family: ``adam`` without weight
    decay and ``adamw``, on CUDA only), else torch; the log line ``kernel backend: ...`` says which and why
    (see concepts)."""
    comm_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Type of pooled embeddings (forward) and their gradients (backward) on the wire of the output
    all-to-all: ``"fp32"``, ``"bf16"`` or ``"fp16"`` halve those bytes; values are rounded to that type in
    transit, the model still computes in fp32. The unpooled rows of fp16 tables go home as fp16 whatever
    it is (exactly: they are fp16 values), their gradients as it says."""
    init_shards: Literal["copy", "in_place"] = "copy"
    """``"copy"``: shards start from the module's weights. ``"in_place"``: each rank initializes only its own
    shards with the table's ``init`` (for tables built on the ``meta`` device because they are too large to
    materialize). Either way the first rank of each replica group then broadcasts its shards to the group
    (data-parallel tables: rank 0 to all), so every copy starts bit-identical, however each process was
    seeded."""
    validate_inputs: bool = True
    """Check every batch on every rank before any id is sent; a bad batch raises the same ``ValueError`` on
    every rank. The verdict travels in the ids' header exchange (with several shard groups, also one small
    all-reduce per lookup)."""
    pipeline: bool = True
    """Input-dist pipelining in ``fit`` (as TorchRec's ``TrainPipelineSparseDist``): after the forward of
    batch ``i``, a worker thread sends batch ``i + 1``'s ids to their owners (check, routing, header and id
    all-to-alls, on duplicate process groups) while batch ``i`` runs backward and the optimizer; the forward
    of batch ``i + 1`` then waits only for one small all-reduce confirming that every rank's features are the
    ones sent. Bit-identical to ``False`` (ids do not depend on weights; ``tests/system/test_pipeline.py``).
    The next batch comes from Lightning's fetcher (loaders without length) or is read one step ahead from its
    iterator (never from a loader that saves its own position in checkpoints, such as torchdata's
    ``StatefulDataLoader``: a resume would skip the batch read early; such a loader with a length is not
    pipelined). Pipelined: the collections whose training forward gets one of the batch's own
    ``SparseFeatures`` / ``KeyedJaggedTensor`` objects at the first step; a collection whose features turn out
    transformed before its lookup (compared by content with a copy taken when they were sent, so ids, lengths
    or weights edited in place by ``on_after_batch_transfer`` or ``training_step`` count too;
    ``tests/system/test_pipeline_inplace.py``) falls back on every rank, with a warning, and is not pipelined
    afterwards. Not pipelined: the first batch of each epoch, validation, test, predict, a
    ``training_step(dataloader_iter)``, Fabric loops (no fetcher; the option has no effect there). A bad batch
    raises the same ``ValueError`` on every rank, in its own forward. Costs one thread and a second set of
    process groups."""
    verify_replicas: int | Literal["checkpoint", "off"] | None = "checkpoint"
    """Check by digest that the copies of every replicated shard are bit-identical: each rank digests its
    shards' weights and every optimizer state (the fp32 bits summed as int32 with wrap-around, per row,
    then over the rows plainly and weighted by row number: exact, independent of summation order, one read of
    the shards; it catches any change of one element and rows swapped, and misses only changes that cancel
    within a row's sum, such as two of its elements swapped) and one all-gather over the world compares the
    digests of all tables at once (data-parallel tables across the whole world). Copies that differ raise
    ``ReplicaMismatchError`` on every rank, naming the table, the shard's rows and columns, weights or state,
    and the ranks whose copy differs. ``"checkpoint"``: before every checkpoint is written (a mismatch writes
    nothing) and at the end of fit; nothing per step. An int ``N``: also after every ``N``-th reduction that
    leaves the copies identical (a blocking round; every step with ``sync_mode="gradients"``; with
    ``sync_overlap``, only the rounds that drains complete). ``"off"`` or ``None``: never.
    ``check_replicas()`` runs it on demand (in a Fabric loop, which has no end of fit, call it at the end;
    ``fabric.save`` checks). Cost on 2 CPU ranks each holding 10.2 M elements: 7 to 16 ms a check against 42
    to 73 ms a step, so ``N=1`` would cost 16 to 22 % of a step and ``N=100`` 0.2 %; the default costs nothing
    per step (``docs/benchmarks.md``)."""
    memory_per_rank_gb: float | None = None
    """Memory a rank may spend on its shards (weights + optimizer state); default: the GPU's memory, or host
    memory (its cgroup limit, if lower) / ranks per node. Every rank plans with the smallest rank's value, and
    the ranks check that they all hold the same plan. Set-up fails early, naming the tables, when a plan
    exceeds it."""
    plan: str | None = None
    """Path of a ``ShardingPlan`` YAML to use as it is instead of planning (see ``docs/planner.md``)."""
    planner_batch_size: int | None = None
    """Samples per rank and step the planner assumes for buffers and traffic. ``None``: the ``batch_size`` of
    the LightningModule or of the datamodule (attribute or hparam, where Lightning's batch size finder looks);
    under Fabric, of the module or of the first loader set up before ``fabric.setup`` (``fabric.md``); else
    512."""
    allow_column_wise: bool = False
    """Let the planner cut hot tables column-wise under row-wise AdaGrad (one accumulator per column block, as
    TorchRec). Off: the planner keeps the optimizer's arithmetic exact (column-wise only under SGD, ``adam`` and
    ``adamw``, whose state is element-wise, or where ``sharding`` asks for it). ``rowwise_adam`` and ``lamb``
    read whole rows: with them column-wise is refused, here and in ``sharding``."""
    links: str | Any = "auto"
    """What the planner predicts step times on. ``"auto"``, when the layout is chosen by cost
    (``shard_group_size`` or ``placement`` is ``"auto"``): the links cache's entry for this job's hosts, world
    size, ranks per node and device, if measured in the last 7 days (no probe), else measured at set-up and
    kept there (``$LIGHTNING_TWOD_CACHE/links``, else ``~/.cache/lightning-twod/links``; rank 0 reads and
    writes it, every rank plans with its numbers): bandwidth and latency of all-to-all and all-reduce inside a
    node and across nodes, a rank's lookup, copy and dense throughput, and the share of an all-reduce's time
    that compute running beside it still pays (``overlap_share``), every rank taking part at once, three
    probes of a 1 s budget each, each number the fastest of the three, then the overlap share once (about 3 s, 6 s on the two-node testbed; longer where ranks share CPU
    cores, see docs/planner.md; a probe that fails raises the same error on every rank). With a pinned layout
    the partition balances on the ``"h100"`` preset's numbers (named ``unmeasured`` on a CPU). ``"measure"``:
    measured at every set-up, and the cache's entry replaced. A path: a YAML file written by ``python -m
    lightning_twod calibrate`` (read at construction; a missing, unreadable or incomplete file raises
    ``ValueError`` naming the file and the field). ``"h100"``, ``"a100-p4d"``: presets for planning offline."""
    lookup_stats: dict[str, dict[str, Any]] | Literal["auto"] | None = "auto"
    """How the tables are looked up, what the planner predicts rows touched, bytes sent and load with, per
    table: ``pooling_factor`` (ids per sample and feature), ``id_skew`` (row popularity: ``id = floor(rows * u
    ** id_skew)``, 1 = uniform), ``hashed`` (the popular rows scattered over the table, not the lowest ids) and
    ``weighted`` (per-id weights). ``"auto"``: in ``fit``, where the layout is chosen by cost (``shard_group_size``
    or ``placement`` ``"auto"``), rank 0 estimates them from the first batch of the training data, built from the
    train dataloader's map-style dataset with its ``collate_fn`` (the loader is not iterated: no worker starts,
    no random state moves), and every rank plans on its numbers (``docs/planner.md``); none where the dataset is
    an ``IterableDataset``, where there is no train dataloader (Fabric) or where the batch holds no
    ``SparseFeatures`` / ``KeyedJaggedTensor``, and the log says so. A mapping ``{table: {field: value}}``: those
    values, over the sampled ones for the tables and fields it names (a table the model does not have, or an
    unknown field, raises naming it). ``None``: none (every feature one id per sample, uniform over the rows).
    The plan's first log line says which were used."""
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
        object.__setattr__(self, "sparse_betas", tuple(float(b) for b in self.sparse_betas))
        object.__setattr__(self, "sparse_per_table", {table: dict(entry) for table, entry in
                                                      (self.sparse_per_table or {}).items()})
        if isinstance(self.lookup_stats, Mapping):
            object.__setattr__(self, "lookup_stats", {table: dict(entry) for table, entry in self.lookup_stats.items()})
        if self.sync_mode == "gradients":
            object.__setattr__(self, "kernel_backend", "torch")

    def _check(self, owner: str) -> None:
        """Raise ``OptionError`` naming ``owner``, the first bad option and what to use instead."""
        def fail(text: str) -> None:
            raise OptionError(f"{owner}: {text}")

        group, interval = self.shard_group_size, self.sync_interval
        if group != AUTO_GROUP_SIZE and not _positive_int(group):
            fail(f"shard_group_size={group!r}; use a positive int or 'auto'")
        if not _positive_int(interval):
            fail(f"sync_interval={interval!r}; use an int >= 1 (steps between reductions)")
        for name, value, allowed in (("placement", self.placement, (*PLACEMENTS, "auto")),
                                     ("sync_mode", self.sync_mode, SYNC_MODES),
                                     ("sparse_optimizer", self.sparse_optimizer, (*OPTIMIZERS, *ADAM_OPTIMIZERS)),
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
        if self.allow_column_wise and self.sparse_optimizer in ROW_NORM_OPTIMIZERS:
            fail(column_wise_refusal(self.sparse_optimizer, "allow_column_wise=True"))
        if not _positive_number(self.sparse_lr):
            fail(f"sparse_lr={self.sparse_lr!r}; the sparse optimizer needs lr > 0")
        if not (_number(self.sparse_eps) and self.sparse_eps >= 0):
            fail(f"sparse_eps={self.sparse_eps!r}; the sparse optimizer needs eps >= 0")
        betas = self.sparse_betas
        if not (isinstance(betas, tuple | list) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
            fail(f"sparse_betas={betas!r}; use two numbers (beta1, beta2) with 0 <= beta < 1, e.g. (0.9, 0.999)")
        decay = self.sparse_weight_decay
        if not (_number(decay) and decay >= 0):
            fail(f"sparse_weight_decay={decay!r}; use a number >= 0")
        if decay and self.sparse_optimizer not in ADAM_OPTIMIZERS:
            fail(f"sparse_weight_decay={decay!r}; sparse_optimizer={self.sparse_optimizer!r} has no weight decay: "
                 f"set it to 0 or use one of {ADAM_OPTIMIZERS}")
        per_table = self.sparse_per_table
        if not isinstance(per_table, Mapping | None):
            fail(f"sparse_per_table={per_table!r}; use {{table: {{optimizer: ..., lr: ...}}}} or None")
        optimizers = {}
        for table, entry in (per_table or {}).items():
            try:
                optimizers[table] = table_settings(self.optimizer_settings, entry, table).optimizer
            except ValueError as err:
                fail(str(err))
        for table, entry in (self.sharding or {}).items():
            optimizer = optimizers.get(table, self.sparse_optimizer)
            if parse_table_choice(entry, table).sharding_type == ShardingType.COLUMN_WISE \
                    and optimizer in ROW_NORM_OPTIMIZERS:
                own = f" (sparse_per_table gives table {table!r} {optimizer!r})" if table in optimizers else ""
                fail(column_wise_refusal(optimizer, f"sharding asks for table {table!r} column_wise") + own)
        if self.memory_per_rank_gb is not None and not _positive_number(self.memory_per_rank_gb):
            fail(f"memory_per_rank_gb={self.memory_per_rank_gb!r}; use GiB > 0 or None (the device's share)")
        stats = self.lookup_stats
        if not isinstance(stats, Mapping) and stats not in ("auto", None):
            fail(f"lookup_stats={stats!r}; use 'auto' (sampled from the training data), None, or "
                 f"{{table: {{field: value}}}} with the fields {', '.join(STAT_FIELDS)}")
        problem = check_lookup_stats(stats) if isinstance(stats, Mapping) else ""
        if problem:
            fail(f"lookup_stats: {problem}")

    @property
    def optimizer_settings(self) -> OptimizerSettings:
        """The strategy-wide sparse optimizer settings (those of a table without a ``sparse_per_table`` entry)."""
        return OptimizerSettings(self.sparse_optimizer, self.sparse_lr, self.sparse_eps, tuple(self.sparse_betas),
                                 self.sparse_weight_decay, self.momentum_scale)

    @property
    def table_optimizers(self) -> dict[str, OptimizerSettings]:
        """``sparse_per_table`` parsed: per table named there, its settings."""
        return {table: table_settings(self.optimizer_settings, entry, table)
                for table, entry in self.sparse_per_table.items()}

    @property
    def table_choices(self) -> dict[str, TableChoice]:
        """``sharding`` parsed: per table, the type and group size it fixes."""
        return {table: parse_table_choice(entry, table) for table, entry in self.sharding.items()}

    def workload(self, batch_size: int) -> Workload:
        """One training step as the planner predicts it under these options, ``batch_size`` samples per rank."""
        return Workload(batch_size=batch_size, optimizer=self.sparse_optimizer,
                        comm_bytes=FP32_BYTES if self.comm_dtype == "fp32" else 2, sync_mode=self.sync_mode,
                        sync_interval=self.sync_interval, sync_bytes=SYNC_BYTES[self.sync_dtype],
                        sync_overlap=self.sync_overlap, allow_column_wise=self.allow_column_wise,
                        table_optimizers=tuple((table, settings.optimizer)
                                               for table, settings in self.table_optimizers.items()))


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


def build_options(owner: str, arguments: Mapping[str, Any], extra: Mapping[str, Any],
                  host: Callable[..., Any]) -> TwoDOptions:
    """The ``TwoDOptions`` of strategy ``owner`` (its class name, in every error): one per field, from
    ``arguments`` (the strategy's ``locals()`` in its ``__init__``), once ``check_extra_arguments`` accepted
    ``extra`` (its other keyword arguments, which go to ``host``)."""
    check_extra_arguments(owner, extra, host)
    return TwoDOptions(**{f.name: arguments[f.name] for f in fields(TwoDOptions)}, owner=owner)


@functools.cache
def option_docs() -> dict[str, str]:
    """``{option: documentation}``: the string below each ``TwoDOptions`` field, on one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(TwoDOptions))).body[0].body
    return {node.target.id: " ".join(doc.value.value.split()) for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)}


def strategy_docstring(summary: str) -> str:
    """A strategy's docstring: ``summary``, then ``Args:`` with every 2D option and ``HOST_ARGUMENTS``."""
    docs = {**option_docs(), **{name: doc for name, (_, doc) in HOST_ARGUMENTS.items()}}
    args = [textwrap.fill(f"{name}: {doc}", 116, initial_indent="    ", subsequent_indent="        ",
                          break_long_words=False, break_on_hyphens=False) for name, doc in docs.items()]
    return f"{summary}\n\nArgs:\n" + "\n".join(args) + "\n"


def options_table() -> str:
    """The Markdown table of ``docs/configuration.md``: every 2D option, then ``HOST_ARGUMENTS``."""
    rows = [(f.name, f.default, option_docs()[f.name]) for f in fields(TwoDOptions)]
    rows += [(name, default, doc) for name, (default, doc) in HOST_ARGUMENTS.items()]
    return "\n".join(["| argument | default | meaning |", "|---|---|---|"] +
                     [f"| `{name}` | `{_literal(default)}` | {doc.replace('``', '`')} |" for name, default, doc in rows])


def configuration_page(text: str) -> str:
    """``text`` (a page with ``TABLE_START`` and ``TABLE_END`` lines) with ``options_table`` between them."""
    before, rest = text.split(TABLE_START, 1)
    after = rest.split(TABLE_END, 1)[1]
    return f"{before}{TABLE_START}\n{options_table()}\n{TABLE_END}{after}"


def write_configuration_table(path: Path = CONFIGURATION_PAGE) -> None:
    """Rewrite the options table of ``docs/configuration.md`` from the ``TwoDOptions`` fields."""
    path.write_text(configuration_page(path.read_text()))


def _literal(value: Any) -> str:
    """``value`` as a Python literal, strings in double quotes: ``"auto"``, ``None``, ``1e-8``."""
    return f'"{value}"' if isinstance(value, str) else re.sub(r"e-0(\d)", r"e-\1", repr(value))


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


if __name__ == "__main__":
    write_configuration_table(Path(sys.argv[1]) if len(sys.argv) > 1 else CONFIGURATION_PAGE)
