"""``TwoDSparseStrategy``: 2D sparse parallelism as a Lightning strategy (Lightning glue only).

Set-up order, on every rank:

1. process group (Lightning's DDP set-up: subprocess, spawn/fork, torchrun or SLURM), then the 2D
   mesh: ``world = replicas x shard_group_size`` (``topology.SparseParallelDims``);
2. every embedding module of the LightningModule is swapped for its sharded twin, starting from
   the weights the module holds (the user's initialization is kept);
3. the dense rest is wrapped in DDP over the whole world, and the user's ``configure_optimizers``
   sees only dense parameters.

One training step (``optimizer_step``), in this order:

1. forward and backward (the closure): ids go to their owners inside the shard group, pooled
   vectors come back; backward returns gradients to the owners, scaled by ``1 / shard_group_size``
   so that each copy gets the gradient of its group's mean loss; DDP averages dense gradients;
2. the user's dense optimizer step;
3. the sparse step: FBGEMM kernels already updated their rows in backward; torch kernels apply the
   sparse optimizer now (``sync_mode="gradients"``: after averaging the touched rows' gradients
   over the replica axis);
4. every ``sync_interval`` steps (``sync_mode="weights"``), the cross-group reduction averages the
   touched rows' weights and optimizer state over the replica axis (``replication``); with
   ``sync_overlap`` it is launched here and applied when the next one is due.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_twod import checkpoint as ckpt
from lightning_twod.consensus import agree_min, check_same, raise_on_every_rank
from lightning_twod.launcher import TwoDMultiProcessingLauncher
from lightning_twod.machine import memory_per_rank_bytes
from lightning_twod.sparse.optimizers import OPTIMIZERS, SparseOptimizerConfig, layout_optimizer
from lightning_twod.replication import WIRE_DTYPES, ReplicaReducer, ReplicatedKernel, reduce_sparse_gradients
from lightning_twod.sparse.comm import ByteCounter
from lightning_twod.sparse.kernels import BACKENDS, fbgemm_available, resolve_backend
from lightning_twod.sparse.sharded import _ShardedCollection
from lightning_twod.planner import ShardingPlan, plan_for_strategy
from lightning_twod.sparse.sharding import parse_sharding_type
from lightning_twod.sparse.wrap import embedding_tables, shard_model
from lightning_twod.topology import PLACEMENTS, MeshGroups, SparseParallelDims, destroy_process_groups_at_exit

SYNC_MODES = ("weights", "gradients")
COMM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Trainer precisions the sparse path supports: no loss scaling, embedding outputs in fp32.
PRECISIONS = ("32-true", "bf16-mixed")


class TwoDSparseStrategy(DDPStrategy):
    """Shards embedding tables inside groups of ``shard_group_size`` ranks; the groups are replicas.

    Args:
        shard_group_size: ranks per shard group (the "2D split ratio"); must divide the world size.
            ``world_size`` gives 1D (full) sharding. ``"auto"``: the planner's choice, the smallest
            group in which the tables fit (preferring groups inside one node), explained in the log.
        placement: ``"contiguous"``: a shard group is consecutive ranks (one node: all-to-all stays
            local); ``"strided"``: a replica group is consecutive ranks (TorchRec's 2D layout).
        sync_interval: optimizer steps between cross-group reductions (``sync_mode="weights"``).
            Validation, test, predict and every checkpoint first complete a reduction, so they see
            identical copies; the interval restarts there.
        sync_dtype: payload of the reduction on the wire: ``"fp32"`` (the rows), or ``"bf16"``: each copy
            sends its rows' change since the last reduction in bf16 (half the bytes; every copy
            applies the same averaged change, so the copies stay bit-identical; costs one reference
            copy of the replicated shards' weights and state in memory).
        sync_overlap: run the reduction in the background: launched after the update of a step at
            which it is due, applied ``sync_interval`` steps later, right before the next one is
            launched, as ``w <- w + (mean - w_launch)`` on the rows that changed meanwhile (the mean
            itself elsewhere); the transfer has ``sync_interval`` steps of training to hide under.
            Validation, checkpoints and the end of fit wait for it and complete a reduction, after
            which every copy is bit-identical.
        sync_mode: ``"weights"``: average touched rows' weights and optimizer state over the replica
            axis every ``sync_interval`` steps; ``"gradients"``: average touched rows' gradients over
            the replica axis before every update (exactly 1D training; torch kernels).
        sparse_optimizer: ``"rowwise_adagrad"``, ``"momentum_rowwise_adagrad"`` or ``"sgd"``.
        sparse_lr: learning rate of the embedding rows.
        sparse_eps: AdaGrad epsilon.
        momentum_scale: accumulator divisor of ``"momentum_rowwise_adagrad"``; ``"auto"``: the factor by
            which the layout makes a row's accumulator grow faster than in 1D: the number of replica
            groups for sharded tables, the world size for data-parallel tables, 1 with
            ``sync_mode="gradients"``. A number is used as it is for every table.
        sharding: per-table sharding type, e.g. ``{"item": "row_wise"}`` (``table_wise``,
            ``row_wise``, ``column_wise``, ``data_parallel``); other tables are table-wise. Plain
            ``nn.EmbeddingBag``/``nn.Embedding`` attributes are named by their attribute path.
        kernel_backend: ``"auto"``, ``"torch"`` or ``"fbgemm"``; one backend for every kernel of the model,
            the same on every rank. ``"auto"``: FBGEMM when it imports on every rank and every shard
            width is a multiple of 4, else torch; the log says which and why.
        comm_dtype: type of the pooled embeddings and their gradients on the wire of the output
            all-to-all: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (half the bytes; values rounded).
        init_shards: ``"copy"``: shards start from the module's weights; ``"in_place"``: each rank
            initializes only its shards (for tables too large to materialize; build them on ``meta``).
            Either way the first rank of each replica group then sends its shards to the others
            (data-parallel tables: rank 0 to all), so every copy starts equal however each process
            was seeded.
        validate_inputs: check ids, lengths and keys of every batch on every rank before any
            collective (one small all-reduce per lookup); a bad batch raises ``ValueError`` everywhere.
        memory_per_rank_gb: memory a rank may spend on its shards; default: the device's memory
            (CUDA) or host memory (or its cgroup limit, if lower) divided by the ranks of a node
            (CPU). Every rank plans with the smallest rank's value, so all ranks get one plan.
        plan: path of a ``ShardingPlan`` YAML (``python -m lightning_twod plan ... --save``) to use
            as it is instead of planning; checked against the model's tables and the world size.
        planner_batch_size: samples per rank and step that the planner assumes for buffers and
            traffic when it balances the plan and checks memory.
        allow_column_wise: let the planner cut hot tables column-wise under row-wise AdaGrad, which
            gives each column block its own accumulator (TorchRec's arithmetic, not the unsharded
            table's). Off by default: the planner then keeps the optimizer exact (column-wise only
            under SGD, or where ``sharding`` asks for it).
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (CUDA default).
        timeout: seconds a collective may wait before the process group fails (a dead rank then
            stops the others instead of hanging them).
        start_method: ``"popen"`` (Lightning's subprocess launcher; torchrun/SLURM), ``"spawn"``,
            ``"fork"`` (notebooks).
    """

    strategy_name = "twod_sparse"

    def __init__(
        self,
        shard_group_size: int | Literal["auto"] = "auto",
        placement: Literal["contiguous", "strided"] = "contiguous",
        sync_interval: int = 1,
        sync_mode: Literal["weights", "gradients"] = "weights",
        sync_dtype: Literal["fp32", "bf16"] = "fp32",
        sync_overlap: bool = False,
        sparse_optimizer: Literal["rowwise_adagrad", "momentum_rowwise_adagrad", "sgd"] = "rowwise_adagrad",
        sparse_lr: float = 0.01,
        sparse_eps: float = 1e-8,
        momentum_scale: float | Literal["auto"] = "auto",
        sharding: dict[str, str] | None = None,
        kernel_backend: Literal["auto", "torch", "fbgemm"] = "auto",
        comm_dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        init_shards: Literal["copy", "in_place"] = "copy",
        validate_inputs: bool = True,
        memory_per_rank_gb: float | None = None,
        plan: str | None = None,
        planner_batch_size: int = 512,
        allow_column_wise: bool = False,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        super().__init__(process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method, **kwargs)
        name = type(self).__name__
        if shard_group_size != "auto" and (isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int)
                                           or shard_group_size < 1):
            raise ValueError(f"{name}: shard_group_size={shard_group_size!r}; use a positive int or 'auto'")
        if placement not in PLACEMENTS:
            raise ValueError(f"{name}: placement={placement!r}; use one of {PLACEMENTS}")
        if isinstance(sync_interval, bool) or not isinstance(sync_interval, int) or sync_interval < 1:
            raise ValueError(f"{name}: sync_interval={sync_interval!r}; use an int >= 1 (steps between reductions)")
        if sync_mode not in SYNC_MODES:
            raise ValueError(f"{name}: sync_mode={sync_mode!r}; use one of {SYNC_MODES}")
        if sparse_optimizer not in OPTIMIZERS:
            raise ValueError(f"{name}: sparse_optimizer={sparse_optimizer!r}; use one of {OPTIMIZERS}")
        if momentum_scale != "auto" and not (isinstance(momentum_scale, (int, float)) and momentum_scale > 0):
            raise ValueError(f"{name}: momentum_scale={momentum_scale!r}; use a number > 0 or 'auto'")
        if kernel_backend not in BACKENDS:
            raise ValueError(f"{name}: kernel_backend={kernel_backend!r}; use one of {BACKENDS}")
        if comm_dtype not in COMM_DTYPES:
            raise ValueError(f"{name}: comm_dtype={comm_dtype!r}; use one of {tuple(COMM_DTYPES)}")
        if sync_dtype not in WIRE_DTYPES:
            raise ValueError(f"{name}: sync_dtype={sync_dtype!r}; use one of {tuple(WIRE_DTYPES)}")
        if sync_mode == "gradients" and (sync_dtype != "fp32" or sync_overlap):
            raise ValueError(f"{name}: sync_dtype and sync_overlap shape the weights reduction; "
                             "sync_mode='gradients' averages every step's gradients exactly: drop them")
        if sync_mode == "gradients" and kernel_backend == "fbgemm":
            raise ValueError(f"{name}: sync_mode='gradients' averages gradients before the update, but FBGEMM "
                             "updates rows inside backward; use kernel_backend='torch' or 'auto'")
        for table, kind in (sharding or {}).items():
            parse_sharding_type(kind, table)
        SparseOptimizerConfig(sparse_optimizer, sparse_lr, sparse_eps)  # validates lr and eps now
        self.shard_group_size = shard_group_size
        self.placement = placement
        self.sync_interval = sync_interval
        self.sync_mode = sync_mode
        self.sync_dtype = sync_dtype
        self.sync_overlap = bool(sync_overlap)
        self.sparse_optimizer = sparse_optimizer
        self.sparse_lr = sparse_lr
        self.sparse_eps = sparse_eps
        self.momentum_scale = momentum_scale
        self.sharding = dict(sharding or {})
        self.kernel_backend = "torch" if sync_mode == "gradients" else kernel_backend
        self.comm_dtype = comm_dtype
        self.init_shards = init_shards
        self.validate_inputs = validate_inputs
        self.memory_per_rank_gb = memory_per_rank_gb
        self.plan = plan
        self.planner_batch_size = planner_batch_size
        self.allow_column_wise = allow_column_wise
        self.sharding_plan: ShardingPlan | None = None
        self._plans: dict[str, dict] = {}
        self.byte_counter: ByteCounter | None = None
        self.sparse_modules: dict[str, _ShardedCollection] = {}
        self._groups: MeshGroups | None = None
        self._replicated: list[ReplicatedKernel] = []
        self.reducer: ReplicaReducer | None = None
        self._sparse_steps = 0
        self._pending_steps = 0  # optimizer steps since the last cross-group reduction
        self._backend, self._backend_reason = "torch", ""
        self._unsharded_parameters: list[tuple[str, bool]] = []  # (name, is a table) before the swap
        self.last_sync_rows = 0
        self._loaded_distributed = False

    # ------------------------------------------------------------------ registry and launch
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``twod_sparse`` (subprocess/torchrun), ``_spawn`` and ``_notebook`` (fork)."""
        for name, start_method, what in (
            ("twod_sparse", "popen", "subprocess launcher; also under torchrun and SLURM"),
            ("twod_sparse_spawn", "spawn", "spawned processes"),
            ("twod_sparse_notebook", "fork", "forked processes, usable inside Jupyter"),
        ):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"2D sparse parallelism ({what})",
                                           start_method=start_method)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = TwoDMultiProcessingLauncher(self, start_method=self._start_method)

    # ------------------------------------------------------------------ mesh
    @property
    def mesh_groups(self) -> MeshGroups:
        """This rank's world, shard-group and replica-group process groups (after set-up)."""
        if self._groups is None:
            raise RuntimeError(f"{type(self).__name__}: the mesh exists only after the Trainer set up the processes")
        return self._groups

    @property
    def device_mesh(self):
        """The 2-D ``DeviceMesh`` with dims ``("replicate", "shard")``."""
        return self.mesh_groups.mesh

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_groups_at_exit()
        world, name, group = self.world_size, type(self).__name__, _world_group()
        # Each decision below is taken from numbers every rank shares, and each step that can fail
        # fails on every rank at once: a rank left behind would wait in the next collective.
        with raise_on_every_rank(group):
            if self.shard_group_size != "auto":
                SparseParallelDims(world, self.shard_group_size, self.placement)  # names the divisors if it is off
            tables = embedding_tables(self.lightning_module)
            if not tables:
                raise MisconfigurationException(
                    f"{name} found no embedding tables in {type(self.lightning_module).__name__}: add an "
                    "EmbeddingBagCollection, EmbeddingCollection, nn.EmbeddingBag or nn.Embedding, or use "
                    "strategy='ddp' for a model without sparse features"
                )
            local = (self._memory_budget(), float(fbgemm_available()))
        budget, fbgemm_everywhere = agree_min(local, group)
        with raise_on_every_rank(group):
            try:
                planned = plan_for_strategy(
                    tables, world, self.num_processes, self.planner_batch_size, budget, self.sharding,
                    self.shard_group_size, placement=self.placement, optimizer=self.sparse_optimizer,
                    sync_interval=self.sync_interval, sync_mode=self.sync_mode, sync_dtype=self.sync_dtype, pinned=self.plan,
                    allow_column_wise=self.allow_column_wise,
                )
                widths = [shard.dim for plans in planned.plans.values() for sharding in plans.values()
                          for shard in sharding.shards]
                self._backend, self._backend_reason = resolve_backend(self.kernel_backend, widths,
                                                                      bool(fbgemm_everywhere))
            except (ValueError, RuntimeError) as err:
                raise MisconfigurationException(f"{name}: {err}") from err
        check_same("sharding plan", f"{planned.plan.to_yaml()}\nbackend={self._backend}", group)
        self.sharding_plan, self._plans = planned.plan, planned.plans
        rank_zero_info(f"{name}: {planned.explanation}")
        dims = SparseParallelDims(world, planned.group_size, self.placement, ranks_per_node=self.num_processes)
        self._groups = MeshGroups.create(dims, device_type=self.root_device.type, timeout=self._timeout)
        self.byte_counter = ByteCounter(self.global_rank, world)

    def sparse_optimizer_config(self, data_parallel: bool = False) -> SparseOptimizerConfig:
        """The sparse optimizer of the sharded tables (or of the data-parallel ones) on this mesh."""
        dims = self.mesh_groups.dims
        return layout_optimizer(self.sparse_optimizer, self.sparse_lr, self.sparse_eps, self.momentum_scale,
                                data_parallel=data_parallel, world_size=dims.world_size,
                                shard_group_size=dims.shard_group_size, sync_mode=self.sync_mode)

    # ------------------------------------------------------------------ model set-up
    @override
    def setup(self, trainer) -> None:
        with raise_on_every_rank(_world_group()):
            self._check_trainer(trainer)
        self._shard_model()
        super().setup(trainer)

    @override
    def setup_optimizers(self, trainer) -> None:
        with raise_on_every_rank(_world_group()):  # the user's configure_optimizers may fail on one rank
            super().setup_optimizers(trainer)

    def _shard_model(self) -> None:
        model = self.lightning_module
        if model is None:
            raise MisconfigurationException(f"{type(self).__name__}: no LightningModule to shard")
        groups = self.mesh_groups
        before = [n for n, _ in model.named_parameters()]
        self.sparse_modules = shard_model(
            model, groups, plan_for=lambda path, tables: self._plans[path], optimizer=self.sparse_optimizer_config(),
            data_parallel_optimizer=self.sparse_optimizer_config(data_parallel=True), backend=self._backend,
            grad_scale=1.0 / groups.dims.shard_group_size, counter=self.byte_counter, device=self.root_device,
            init=self.init_shards, comm_dtype=COMM_DTYPES[self.comm_dtype],
        )
        dense = {n for n, _ in model.named_parameters()}
        self._unsharded_parameters = [(n, n not in dense) for n in before]
        self._replicated = []
        for module in self.sparse_modules.values():
            module.validate_inputs = self.validate_inputs
            if module.kernel is not None:
                self._replicated.append(ReplicatedKernel(module.kernel, groups.replica, groups.replica_ranks))
            if module.local_kernel is not None:
                self._replicated.append(
                    ReplicatedKernel(module.local_kernel, groups.world, list(range(groups.dims.world_size))))
        if self.sync_mode == "weights":
            self.reducer = ReplicaReducer(self._replicated, self.sync_dtype, self.byte_counter)
        self._log_layout(model)

    def _memory_budget(self) -> float:
        if self.memory_per_rank_gb is not None:
            return self.memory_per_rank_gb * 2**30
        return memory_per_rank_bytes(self.root_device, self.num_processes)

    def _check_trainer(self, trainer) -> None:
        name = type(self).__name__
        precision = str(self.precision_plugin.precision)
        if precision == "16-mixed":
            raise MisconfigurationException(
                f"{name}: precision='16-mixed' scales the loss, and the sparse path would apply the scaled "
                "gradients to the embedding rows (inside backward with FBGEMM), also on overflow steps that "
                "the dense optimizer skips; use precision='bf16-mixed' (no loss scaling) or '32-true'"
            )
        if precision not in PRECISIONS:
            raise MisconfigurationException(
                f"{name}: precision={precision!r} is not supported (embedding rows and their outputs stay in "
                f"fp32); use one of {PRECISIONS}"
            )
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.accumulate_grad_batches > 1 and self._backend == "fbgemm":
            raise MisconfigurationException(
                f"{name}: accumulate_grad_batches={trainer.accumulate_grad_batches} needs the torch kernels "
                "(FBGEMM updates embedding rows inside every backward); set kernel_backend='torch'"
            )
        if trainer.gradient_clip_val:
            raise MisconfigurationException(
                f"{name}: gradient clipping would clip only the dense parameters and silently leave the "
                "embedding rows unclipped; remove gradient_clip_val (row-wise AdaGrad already normalizes rows)"
            )

    @override
    def configure_ddp(self) -> None:
        if not any(p.requires_grad for p in self.model.parameters()):
            return  # only embedding tables: nothing dense for DDP to average
        super().configure_ddp()
        self._fix_gradient_buckets()

    def _fix_gradient_buckets(self) -> None:
        """Give DDP its final gradient buckets now (parameter order), for a bit-exact resume.

        DDP re-buckets the dense gradients once, after the first backward of every ``fit``, in the
        order they became ready. A run resumed from a checkpoint would all-reduce its first step with
        the initial buckets where the uninterrupted run used the rebuilt ones; the all-reduce then
        sums each element in another order (gloo and NCCL split a bucket into chunks by offset),
        and the resumed run drifts by ~1e-8. Building the buckets before the first step (a
        collective) keeps one layout for every step of every run. DDP with ``static_graph`` or
        ``find_unused_parameters`` is left as it is (the latter never re-buckets).
        """
        reducer = getattr(self.model, "reducer", None)
        if (reducer is None or getattr(self.model, "static_graph", False)
                or getattr(self.model, "find_unused_parameters", False)
                or not hasattr(reducer, "_push_all_rebuilt_params")):
            return
        reducer._push_all_rebuilt_params()
        reducer._rebuild_buckets()

    def _log_layout(self, model) -> None:
        dims = self.mesh_groups.dims
        dense = sum(p.numel() for p in model.parameters())
        sparse = sum(t.num_embeddings * t.embedding_dim for m in self.sparse_modules.values() for t in m.tables)
        local = sum(w.numel() for m in self.sparse_modules.values() for _, w in m.local_shards())
        optimizer = f"sparse optimizer={self.sparse_optimizer_config()}"
        if any(m.local_kernel is not None for m in self.sparse_modules.values()):
            optimizer += f" (data-parallel tables: {self.sparse_optimizer_config(data_parallel=True)})"
        lines = [
            f"{type(self).__name__}: {dims.num_replicas} replica group(s) x {dims.shard_group_size} rank(s) "
            f"per shard group, placement={dims.placement}, sync_mode={self.sync_mode}, "
            f"sync_interval={self.sync_interval}, sync_dtype={self.sync_dtype}, sync_overlap={self.sync_overlap}, "
            f"comm_dtype={self.comm_dtype}, {optimizer}",
            f"kernel backend: {self._backend} ({self._backend_reason})",
            dims.describe(),
            f"parameters: {dense:,} dense (DDP, the user's optimizer), {sparse:,} in embedding tables "
            f"(sharded, sparse optimizer; {local:,} held by rank {self.global_rank})",
        ]
        if self.sharding_plan is not None:
            lines.append(self.sharding_plan.describe())
        for path, module in self.sparse_modules.items():
            lines.append(module.describe_plan(title=path or type(module).__name__))
        rank_zero_info("\n".join(lines))

    # ------------------------------------------------------------------ training step
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if not self.optimizers or optimizer is self.optimizers[0]:
            self.sparse_step()
        return output

    def sparse_step(self) -> None:
        """Update embedding rows, then reduce over the replica axis when the interval is due."""
        for replicated in self._replicated:
            if self.sync_mode == "gradients":
                replicated.kernel.step(reduce_sparse_gradients(replicated, self.byte_counter))
            else:
                replicated.kernel.step()
        self._sparse_steps += 1
        if self.reducer is None:
            return
        self._pending_steps += 1
        if self._pending_steps == self.sync_interval:
            self.reduce_replicas()  # with sync_overlap: applies the previous round, launches this one

    def reduce_replicas(self, wait: bool | None = None) -> int:
        """Reduce every row touched since the last reduction over its copies; returns rows sent.

        ``wait``: block until it is applied (default: unless ``sync_overlap``, which launches it in
        the background). The interval restarts here.
        """
        if self.reducer is None:
            return 0
        wait = not self.sync_overlap if wait is None else wait
        self.last_sync_rows = self.reducer.reduce() if wait else self.reducer.launch()
        self._pending_steps = 0
        return self.last_sync_rows

    def drain(self) -> None:
        """Apply a round in flight and reduce what changed since: every copy is then identical; a collective."""
        if self.reducer is None:
            return
        self.reducer.finish()
        if self._pending_steps:
            self.reduce_replicas(wait=True)

    @override
    def on_validation_start(self) -> None:
        self.drain()  # scores come from one model, not from a mix of diverged copies
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self.drain()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self.drain()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self.drain()  # leave training with identical copies, also after an unfinished interval
        super().on_train_end()

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards and optimizers must exist: checkpoints load into them in place

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Dense part only; save_checkpoint writes the tables sharded (no gathering on any rank).
        return ckpt.dense_state_dict(self.lightning_module, self.sparse_modules)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write a distributed checkpoint directory (see ``lightning_twod.checkpoint``); a collective.

        An unfinished interval's reduction completes first, so the checkpoint holds the rows every
        copy agrees on (and a resumed run continues exactly as this one does).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        self.drain()
        dims = self.mesh_groups.dims
        layout = {"world_size": dims.world_size, "shard_group_size": dims.shard_group_size,
                  "placement": dims.placement, "sparse_optimizer": str(self.sparse_optimizer_config()),
                  "plans": {path: m.describe_plan() for path, m in self.sparse_modules.items()}}
        checkpoint.setdefault("twod", {})["sparse_steps"] = self._sparse_steps
        ckpt.save_distributed(self.broadcast(str(filepath)), checkpoint, self.lightning_module, self.optimizers,
                              self.sparse_modules, self.mesh_groups, layout)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a distributed checkpoint from any mesh, or a single-file one of the unsharded model."""
        path = self.broadcast(str(checkpoint_path))
        self._loaded_distributed = ckpt.is_distributed_checkpoint(path)
        with raise_on_every_rank(_world_group()):  # e.g. a node that does not see the shared file system
            if self._loaded_distributed:
                ckpt.check_complete(path)
            elif not os.path.isfile(path):
                raise FileNotFoundError(f"{type(self).__name__}: no checkpoint at {path} on rank {self.global_rank}")
        if not self._loaded_distributed:
            state = super().load_checkpoint(path, weights_only=weights_only)
            self._sparse_steps = int(state.get("global_step", 0))
        else:
            state = ckpt.load_distributed(path, self.lightning_module, self.optimizers, self.sparse_modules,
                                          self.mesh_groups)
            self._sparse_steps = state.get("twod", {}).get("sparse_steps", 0)
        self._pending_steps = 0  # checkpoints are written right after a reduction
        return state

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self._loaded_distributed:  # a single-file checkpoint: full tables, sliced by each twin
            super().load_model_state_dict(checkpoint, strict=strict)
        if self.reducer is not None:
            self.reducer.reset_references()  # every copy now holds the loaded rows

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self._loaded_distributed:
            return
        # A single file is the unsharded model's (strategy="ddp" or one device): its optimizers held
        # the tables too, which here belong to the sparse optimizer.
        for index, (optimizer, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            mapped, why = ckpt.dense_optimizer_state(state, optimizer, self._unsharded_parameters,
                                                     self.lightning_module)
            if mapped is None:
                rank_zero_warn(f"{type(self).__name__}: the checkpoint's state of optimizer {index} "
                               f"({type(optimizer).__name__}) is not restored ({why}); it starts afresh")
            else:
                optimizer.load_state_dict(mapped)
        if any(r.kernel.optimizer_states() for r in self._replicated):
            rank_zero_warn(f"{type(self).__name__}: the single-file checkpoint has no row-wise "
                           f"{self.sparse_optimizer} state for the embedding tables; it starts at zero")

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero and ckpt.is_distributed_checkpoint(filepath):
            shutil.rmtree(filepath)
        elif not ckpt.is_distributed_checkpoint(filepath):
            super().remove_checkpoint(filepath)

    def traffic(self) -> dict[str, int]:
        """Bytes this rank sent so far: ``intra`` (inside its shard group) and ``cross`` (outside)."""
        counter, groups = self.byte_counter, self.mesh_groups
        inside = groups.shard_ranks
        outside = [r for r in range(groups.dims.world_size) if r not in inside]
        return {"intra": counter.total(peers=inside), "cross": counter.total(peers=outside)}


def _world_group():
    """The default process group, or None without one (a single process)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
