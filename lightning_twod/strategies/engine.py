"""What the Trainer strategy and the Fabric strategy share: 2D sparse parallelism of one model.

``TwoDSparseEngine`` is a mixin for a Lightning DDP strategy (``lightning.pytorch`` or
``lightning.fabric``): it holds the options (``options.TwoDOptions``, documented on
``TwoDSparseStrategy``), plans the mesh (``planning.MeshPlanning``), swaps the embedding modules
for their sharded twins, runs the sparse step and the cross-group reduction (on the schedule of
``replication.schedule``), and writes and reads distributed checkpoints. The host strategy supplies the process group, its hooks and what
``EngineHost`` lists; nothing here depends on the Trainer or on Fabric.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol, cast

import lightning
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_twod.checkpoint.directory import check_complete, is_distributed_checkpoint
from lightning_twod.checkpoint.distributed import load_distributed, resharding, save_distributed
from lightning_twod.checkpoint.optimizer import dense_optimizer_state
from lightning_twod.distributed import MeshGroups
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.distributed.consensus import raise_on_every_rank
from lightning_twod.planner import ShardingPlan
from lightning_twod.replication import ReplicaCheck, ReplicaReducer, ReplicatedKernel, step_with_mean_gradients
from lightning_twod.replication.reducer import check_single_copies
from lightning_twod.replication.schedule import SyncSchedule
from lightning_twod.sparse.kernels import FbgemmKernel
from lightning_twod.sparse.optimizers import SparseOptimizerConfig, layout_optimizer
from lightning_twod.sparse.sharded import GroupLayout, ShardedCollection, ShardingSpec, all_parts
from lightning_twod.sparse.wrap import shard_model
from lightning_twod.strategies.options import COMM_DTYPES, TwoDOptions
from lightning_twod.strategies.planning import MeshPlanning, world_group

#: Precisions the sparse path supports: no loss scaling, embedding outputs in fp32.
PRECISIONS = ("32-true", "bf16-mixed")

def clipping_refused(owner: str, what_to_remove: str) -> MisconfigurationException:
    """The refusal of gradient clipping by the strategy ``owner`` (its class name), naming what the user
    should remove (``gradient_clip_val``, ``self.clip_gradients``, ``fabric.clip_gradients``)."""
    return MisconfigurationException(
        f"{owner}: gradient clipping would clip only the dense parameters and silently leave the embedding "
        f"rows unclipped; remove {what_to_remove} (row-wise AdaGrad already normalizes rows)"
    )


class EngineHost(Protocol):
    """What ``TwoDSparseEngine`` uses of the Lightning strategy it is mixed into; a ``DDPStrategy`` of
    the Trainer or of Fabric provides it once the accelerator connector has set its devices."""

    @property
    def world_size(self) -> int: ...

    @property
    def num_processes(self) -> int:
        """Ranks on this node."""

    @property
    def num_nodes(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank; a collective."""


class TwoDSparseEngine(MeshPlanning):
    """The 2D state and steps of a strategy; see ``TwoDSparseStrategy`` for the options.

    Mixed into a Lightning ``DDPStrategy`` (before it): ``options`` are the checked 2D options,
    ``timeout`` bounds every collective of the mesh's process groups (and of the host's), the other
    arguments go to the host strategy. Of the host the engine uses ``host`` (an ``EngineHost``).
    """

    def __init__(self, options: TwoDOptions, *, timeout: timedelta, **host_arguments: Any) -> None:
        super().__init__(timeout=timeout, **host_arguments)
        self.options = options
        self.collective_timeout = timeout
        self.sharding_plan: ShardingPlan | None = None
        self._plans: dict[str, dict] = {}
        self.byte_counter: ByteCounter | None = None
        self.sparse_modules: dict[str, ShardedCollection] = {}
        self._groups: MeshGroups | None = None
        self._groups_of_size: dict[int, MeshGroups] = {}  # one mesh per shard group size of the plan
        self._replicated: list[ReplicatedKernel] = []
        self._single_copies: list[ReplicatedKernel] | None = None  # no round checks their rows: checked every step
        self.reducer: ReplicaReducer | None = None
        self.replica_check: ReplicaCheck | None = None
        self.schedule = SyncSchedule()  # when the copies are reduced: the run's, from set-up on
        self._backend, self._backend_reason = "torch", ""
        self._unsharded_parameters: list[tuple[str, bool]] = []  # (name, is a table) before the swap
        self.last_sync_rows = 0

    @property
    def host(self) -> EngineHost:
        """The Lightning strategy this engine is mixed into, as far as the engine uses it."""
        return cast(EngineHost, self)

    # ------------------------------------------------------------------ mesh
    @property
    def mesh_groups(self) -> MeshGroups:
        """This rank's world, shard-group and replica-group process groups (after set-up)."""
        if self._groups is None:
            raise RuntimeError(f"{type(self).__name__}: the mesh exists only after the model was set up")
        return self._groups

    @property
    def device_mesh(self):
        """The 2-D ``DeviceMesh`` with dims ``("replicate", "shard")``."""
        return self.mesh_groups.mesh

    def sparse_optimizer_config(self, data_parallel: bool = False, shard_group_size: int | None = None
                                ) -> SparseOptimizerConfig:
        """The sparse optimizer of the tables sharded over groups of ``shard_group_size`` ranks (default:
        the mesh's), or of the data-parallel ones; ``momentum_scale="auto"`` divides by their replicas."""
        dims, options = self.mesh_groups.dims, self.options
        return layout_optimizer(options.sparse_optimizer, options.sparse_lr, options.sparse_eps, options.momentum_scale,
                                data_parallel=data_parallel, world_size=dims.world_size,
                                shard_group_size=shard_group_size or dims.shard_group_size, sync_mode=options.sync_mode,
                                betas=options.sparse_betas, weight_decay=options.sparse_weight_decay)

    def table_optimizer(self, table: str, data_parallel: bool, shard_group_size: int) -> SparseOptimizerConfig | None:
        """The sparse optimizer of ``table`` (data-parallel, or sharded over groups of ``shard_group_size``) where
        ``sparse_per_table`` gives it settings of its own that differ there from the other tables', else None."""
        settings = self.options.table_optimizers.get(table)
        if settings is None:
            return None
        dims = self.mesh_groups.dims
        config = settings.on_layout(data_parallel=data_parallel, world_size=dims.world_size,
                                    shard_group_size=shard_group_size, sync_mode=self.options.sync_mode)
        return None if config == self.sparse_optimizer_config(data_parallel, shard_group_size) else config

    def sharding_spec(self) -> ShardingSpec:
        """How ``shard_model`` builds the twins on this run's mesh: the plans, each group size's groups,
        sparse optimizer and gradient scale (the mean over a shard group), and the options."""
        groups, options = self.mesh_groups, self.options
        layouts = {size: GroupLayout(mesh, self.sparse_optimizer_config(shard_group_size=size), 1.0 / size)
                   for size, mesh in self._groups_of_size.items()}
        own = layouts.pop(groups.dims.shard_group_size)
        return ShardingSpec(
            groups, own.optimizer, self.sparse_optimizer_config(data_parallel=True), own.grad_scale,
            other_sizes=layouts, plans=self._plans, backend=self._backend, comm_dtype=COMM_DTYPES[options.comm_dtype],
            counter=self.byte_counter, device=self.host.root_device, init=options.init_shards,
            validate_inputs=options.validate_inputs,
            before_read=self.drain,  # reading the tables (state_dict, full_table) sees identical copies
            after_write=self._after_load,  # load_state_dict: a round in flight is never applied to it
            table_optimizer=self.table_optimizer,
        )

    def _check_precision(self, precision: str) -> None:
        name = type(self).__name__
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

    # ------------------------------------------------------------------ model
    def _shard(self, model: nn.Module) -> None:
        """Swap every embedding module of ``model`` for its sharded twin (a collective)."""
        groups, options = self.mesh_groups, self.options
        before = [n for n, _ in model.named_parameters()]
        self.sparse_modules = shard_model(model, self.sharding_spec())
        dense = {n for n, _ in model.named_parameters()}
        self._unsharded_parameters = [(n, n not in dense) for n in before]
        self._replicated = []
        parts = [part for _, part in all_parts(self.sparse_modules)]
        for module in parts:
            shards = {id(kernel): held for kernel, held in module.kernel_shards()}  # named in errors
            if module.kernel is not None:  # each part over its own replica group
                self._replicated.append(ReplicatedKernel(module.kernel, module.groups.replica,
                                                         module.groups.replica_ranks, shards[id(module.kernel)]))
            if module.local_kernel is not None:
                self._replicated.append(ReplicatedKernel(module.local_kernel, groups.world,
                                                         list(range(groups.dims.world_size)), shards[id(module.local_kernel)]))
        # a shard with a single copy (on this rank or another: the plan decides, the same everywhere)
        single = any(m.groups.dims.num_replicas == 1 and any(m.slots) for m in parts) or groups.dims.world_size == 1
        self._single_copies = [r for r in self._replicated if len(r.peers) == 1] if single else None
        # 1D with no data-parallel table (the same on every rank): no copies, so no round and no verdict to agree on
        copies = any(m.groups.dims.num_replicas > 1 or m.local_kernel is not None for m in parts)
        if options.sync_mode == "weights" and copies:  # every rank stops on NaN or inf
            self.reducer = ReplicaReducer(self._replicated, options.sync_dtype, self.byte_counter, across=self._across)
        self.replica_check = ReplicaCheck(self.sparse_modules, groups, self.host.root_device)
        every = options.verify_replicas
        self.schedule = SyncSchedule(options.sync_interval, options.sync_overlap, rounds=self.reducer is not None,
                                     verify_every=every if isinstance(every, int) else None)
        self._log_layout(model)

    @property
    def _across(self):
        """The group that joins the replica groups into the world, over which a round's verdict on NaN and inf
        is agreed: the mesh's shard group (one member of each of its replica groups), or the world where
        tables have their own group sizes (their replica groups differ)."""
        return self.mesh_groups.shard if len(self._groups_of_size) == 1 else self.mesh_groups.world

    def _log_layout(self, model: nn.Module) -> None:
        dims, options = self.mesh_groups.dims, self.options
        parts = [part for _, part in all_parts(self.sparse_modules)]
        dense = sum(p.numel() for p in model.parameters())
        sparse = sum(t.num_embeddings * t.embedding_dim for m in parts for t in m.tables)
        local = sum(w.numel() for m in parts for _, w in m.local_shards())
        optimizer = f"sparse optimizer={self.sparse_optimizer_config()}"
        for size in self._groups_of_size:
            if size != dims.shard_group_size:
                optimizer += f" (tables in groups of {size}: {self.sparse_optimizer_config(shard_group_size=size)})"
        if any(m.local_kernel is not None for m in parts):
            optimizer += f" (data-parallel tables: {self.sparse_optimizer_config(data_parallel=True)})"
        if options.sparse_per_table:
            optimizer += f"; {self.table_optimizer_summary()}"
        lines = [
            f"{type(self).__name__}: {dims.num_replicas} replica group(s) x {dims.shard_group_size} rank(s) "
            f"per shard group, placement={dims.placement}, sync_mode={options.sync_mode}, "
            f"sync_interval={options.sync_interval}, sync_dtype={options.sync_dtype}, "
            f"sync_overlap={options.sync_overlap}, comm_dtype={options.comm_dtype}, {optimizer}",
            f"kernel backend: {self._backend} ({self._backend_reason})",
            dims.describe(),
            f"parameters: {dense:,} dense (DDP, the user's optimizer), {sparse:,} in embedding tables "
            f"(sharded, sparse optimizer; {local:,} held by rank {self.host.global_rank})",
        ]
        if self.sharding_plan is not None:
            lines.append(self.sharding_plan.describe())
        for path, module in self.sparse_modules.items():
            lines.append(module.describe_plan(title=path or type(module).__name__))
        rank_zero_info("\n".join(lines))

    # ------------------------------------------------------------------ steps
    def _fused_kernels(self) -> list[FbgemmKernel]:
        return [r.kernel for r in self._replicated if isinstance(r.kernel, FbgemmKernel)]

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backwards inside are summed with the following ones before the sparse step (gradient
        accumulation: Lightning's ``block_backward_sync``, Fabric's ``no_backward_sync``); FBGEMM
        kernels hold their gradients for the step instead of updating rows in backward."""
        gates = [kernel.gate for kernel in self._fused_kernels()]
        before = [gate.accumulating for gate in gates]
        for gate in gates:
            gate.accumulating = True
        try:
            yield
        finally:
            for gate, was in zip(gates, before, strict=True):
                gate.accumulating = was

    def begin_sparse_steps(self, manual: bool) -> None:
        """At the start of training: nothing is left of a step that did not finish; with ``manual``
        optimization (the backwards of a step are the user's to count) FBGEMM kernels hold every
        gradient for the sparse step."""
        for replicated in self._replicated:
            replicated.kernel.reset_step()
        for kernel in self._fused_kernels():
            kernel.gate.defer = manual

    def sparse_step(self) -> None:
        """Update embedding rows, then reduce over the replica axis when the interval is due. A NaN or inf
        gradient that reached a shard with a single copy raises on every rank first, naming its table."""
        try:
            if self._single_copies is not None:  # a collective, on every rank alike
                check_single_copies(self._single_copies, self.schedule.steps + 1, world_group())
            if self.options.sync_mode == "gradients":  # raises on every rank if a mean gradient is NaN or inf
                step_with_mean_gradients(self._replicated, self.byte_counter, across=self._across)
            else:
                for replicated in self._replicated:
                    replicated.kernel.step()
        except BaseException:
            for replicated in self._replicated:  # nothing of a refused step is carried into the next one
                replicated.kernel.reset_step()
            raise
        due = self.schedule.step()
        if self.options.sync_mode == "gradients":
            self._reduced()  # every copy applied the same averaged gradients
        if due:
            self.reduce_replicas()  # with sync_overlap: applies the previous round, launches this one

    def reduce_replicas(self, wait: bool | None = None) -> int:
        """Reduce every row touched since the last reduction over its copies; returns rows sent.

        ``wait``: block until it is applied (default: unless ``sync_overlap``, which launches it in
        the background). The interval restarts here.
        """
        if self.reducer is None:
            return 0
        wait = self.schedule.waits(wait)
        self.last_sync_rows = self.reducer.reduce() if wait else self.reducer.launch()
        self.schedule.restart()
        if wait:
            self._reduced()
        return self.last_sync_rows

    def _reduced(self) -> None:
        """A reduction left every copy identical: with ``verify_replicas=N``, every N-th is checked
        (with no drain, which would flush int8 residuals: the check changes no result)."""
        if self.schedule.completed() and self.replica_check is not None:
            self.replica_check.verify()

    def check_replicas(self) -> None:
        """Drain, then check by digest that every copy of every replicated shard (weights and optimizer states)
        is bit-identical (``replication.verify``); a collective. Raises
        ``ReplicaMismatchError`` on every rank, naming the tables, shards and ranks, if one is not.
        Runs before every checkpoint and at the end of fit unless ``verify_replicas="off"``."""
        self.drain()
        if self.replica_check is not None:
            self.replica_check.verify()

    def _drain_and_verify(self) -> None:
        """``drain()``, and ``check_replicas()`` unless ``verify_replicas="off"``: before a checkpoint
        and at the end of fit."""
        if self.options.verify_replicas == "off":
            self.drain()
        else:
            self.check_replicas()

    def drain(self) -> None:
        """Apply a round in flight and reduce what changed since (and, on the bf16 wire, the rows in which an
        overlapped round left each copy its residual): every copy is then identical; a collective.
        On the int8 wire the residuals then go into the weights, so that nothing depends on them."""
        if self.reducer is None:
            return
        self.reducer.finish()
        if self.schedule.owed or self.reducer.unsettled:
            self.reduce_replicas(wait=True)
        for replicated in self._replicated:  # in the middle of an accumulation: rows the step will still change
            replicated.kernel.mark_pending()
        self.reducer.flush_residuals()

    def traffic(self) -> dict[str, int]:
        """Bytes this rank sent so far: ``intra`` (inside its shard group of the mesh's size) and ``cross``
        (outside it; with tables in groups of their own size, their all-to-alls count by the same
        mesh's groups)."""
        counter, groups = self.byte_counter, self.mesh_groups
        inside = groups.shard_ranks
        outside = [r for r in range(groups.dims.world_size) if r not in inside]
        return {"intra": counter.total(peers=inside), "cross": counter.total(peers=outside)}

    # ------------------------------------------------------------------ checkpoints
    def _save_sparse(self, path, checkpoint: dict[str, Any], module: nn.Module, optimizers: list) -> None:
        """Write a distributed checkpoint of ``module`` and ``optimizers`` (+ the plain ``checkpoint``
        entries) after completing the reduction of an unfinished interval (and checking the copies
        identical, ``verify_replicas``); a collective."""
        self._drain_and_verify()
        checkpoint.setdefault("twod", {})["sparse_steps"] = self.schedule.steps
        checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)  # the Trainer reads it
        save_distributed(self.host.broadcast(str(path)), checkpoint, module, optimizers, self.sparse_modules,
                         self._layout())

    def _layout(self) -> dict[str, Any]:
        """What ``layout.json`` records of this run: the mesh, the sparse optimizer and the sharding plans."""
        dims = self.mesh_groups.dims
        return {"world_size": dims.world_size, "shard_group_size": dims.shard_group_size,
                "placement": dims.placement, "sparse_optimizer": dataclasses.asdict(self.sparse_optimizer_config()),
                "plans": {p: m.describe_plan() for p, m in self.sparse_modules.items()}}

    def _check_readable(self, path: str) -> bool:
        """Whether ``path`` is a distributed checkpoint; raises on every rank if some rank cannot read it."""
        distributed = is_distributed_checkpoint(path)
        with raise_on_every_rank(world_group()):  # e.g. a node that does not see the shared file system
            if distributed:
                check_complete(path)
            elif not os.path.isfile(path):
                raise FileNotFoundError(f"{type(self).__name__}: no checkpoint at {path} "
                                        f"on rank {self.host.global_rank}")
        return distributed

    def _load_sparse(self, path: str, module: nn.Module, optimizers: list) -> dict[str, Any]:
        """Read a distributed checkpoint of any mesh into ``module`` and ``optimizers``; the rest of it.
        Rank 0 says where the checkpoint was saved on another mesh or with another sharding plan."""
        state = load_distributed(path, module, optimizers, self.sparse_modules, self.mesh_groups)
        change = resharding(path, self._layout())
        if change:
            rank_zero_info(f"{type(self).__name__}: checkpoint {path} was {change}: resharded (each rank "
                           "reads its own rows and columns)")
        self.schedule.steps = state.get("twod", {}).get("sparse_steps", 0)
        self._after_load()
        return state

    def _after_load(self) -> None:
        """The copies were overwritten together: a round in flight and the rows touched since the last
        reduction are discarded, never applied to the loaded rows; the interval restarts, the
        references with it."""
        self.schedule.restart()  # checkpoints are written right after a reduction
        for replicated in self._replicated:  # gradients taken on the rows before the load
            replicated.kernel.reset_step()
        if self.reducer is not None:
            self.reducer.discard()
            self.reducer.reset_references()

    def _load_unsharded_optimizers(self, states: list[Mapping], optimizers: list, module: nn.Module) -> None:
        """Optimizer states of a single-file checkpoint of the unsharded model, mapped onto the dense
        parameters (its table entries belong to the sparse optimizer here)."""
        for index, (optimizer, state) in enumerate(zip(optimizers, states)):
            mapped, why = dense_optimizer_state(state, optimizer, self._unsharded_parameters, module)
            if mapped is None:
                rank_zero_warn(f"{type(self).__name__}: the checkpoint's state of optimizer {index} "
                               f"({type(optimizer).__name__}) is not restored ({why}); it starts afresh")
            else:
                optimizer.load_state_dict(mapped)
        if any(r.kernel.optimizer.has_state for r in self._replicated):
            rank_zero_warn(f"{type(self).__name__}: the single-file checkpoint has no {self.options.sparse_optimizer} "
                           "state for the embedding tables; it starts at zero")
