"""``TwoDSparseFabricStrategy``: 2D sparse parallelism for Lightning Fabric (Fabric glue only).

The Fabric twin of ``TwoDSparseStrategy``, with the same arguments and the same engine
(``engine.TwoDSparseEngine``). In a hand-written loop::

    fabric = Fabric(accelerator="cpu", devices=4, strategy=TwoDSparseFabricStrategy(shard_group_size=2))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)  # tables sharded, dense rest in DDP
    loss = model.loss(batch); fabric.backward(loss)
    optimizer.step()                                   # dense step, then the sparse step and, when
                                                       # due, the cross-group reduction
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})

``fabric.setup`` (or ``setup_module``) plans the mesh and swaps the embedding modules for their
sharded twins; an optimizer built before it loses the tables' parameters (the sparse optimizer
owns them). The step of the first optimizer set up runs the sparse step. The first lookup in eval
mode after training steps drains (applies a round in flight, completes an unfinished interval),
so evaluation sees identical copies; so does whatever reads the tables (``state_dict``,
``full_table``, ``fabric.save``), so a loop needs no closing call. ``fabric.load`` discards a round
in flight. Checkpoints are the Trainer path's distributed format: either loads the other's, on any
mesh. The planner's lookup statistics come from ``lookup_stats`` given as a mapping only: Fabric has
no training data to sample at ``fabric.setup``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Literal, NoReturn

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_twod.core.mesh import AUTO_GROUP_SIZE
from lightning_twod.distributed import destroy_process_groups_at_exit
from lightning_twod.distributed.consensus import raise_on_every_rank
from lightning_twod.planner import StrategyPlan
from lightning_twod.strategies.engine import TwoDSparseEngine, clipping_refused
from lightning_twod.strategies.even_batches import even_batches
from lightning_twod.strategies.options import build_options, strategy_docstring
from lightning_twod.strategies.planning import STATS_FIX, world_group
from lightning_twod.strategies.registration import register_names


def _unwrapped(obj: Any) -> Any:
    return obj.module if isinstance(obj, DistributedDataParallel) else obj


class _AccumulatingSyncControl(_DDPBackwardSyncControl):
    """``fabric.no_backward_sync(model)``: DDP's ``no_sync`` for the dense part (if there is one), and
    the sparse gradients summed until the optimizer step (``TwoDSparseEngine.accumulating``)."""

    def __init__(self, engine: TwoDSparseEngine) -> None:
        self.engine = engine

    @contextmanager
    def _accumulating(self, module: nn.Module) -> Iterator[None]:
        dense = super().no_backward_sync(module, True) if isinstance(module, DistributedDataParallel) else None
        with self.engine.accumulating():
            if dense is None:
                yield
            else:
                with dense:
                    yield

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        return self._accumulating(module) if enabled else super().no_backward_sync(module, enabled)


class TwoDSparseFabricStrategy(TwoDSparseEngine, DDPStrategy):
    __doc__ = strategy_docstring(
        "2D sparse parallelism for Fabric: the arguments of ``TwoDSparseStrategy``, by keyword; other keyword\n"
        "arguments go to ``DistributedDataParallel`` for the dense part. ``pipeline`` has no effect: a Fabric\n"
        "loop has no data fetcher to see the next batch in, so every lookup sends its ids in its forward.")

    def __init__(
        self,
        *,
        shard_group_size: int | Literal["auto"] = AUTO_GROUP_SIZE,
        placement: Literal["contiguous", "strided", "auto"] = "contiguous",
        sync_interval: int = 1,
        sync_mode: Literal["weights", "gradients"] = "weights",
        sync_dtype: Literal["fp32", "bf16", "int8"] = "fp32",
        sync_overlap: bool = False,
        sparse_optimizer: Literal["rowwise_adagrad", "momentum_rowwise_adagrad", "sgd", "adam", "adamw", "rowwise_adam",
                                  "lamb"] = "momentum_rowwise_adagrad",
        sparse_lr: float = 0.01,
        sparse_eps: float = 1e-8,
        sparse_betas: tuple[float, float] = (0.9, 0.999),
        sparse_weight_decay: float = 0.0,
        momentum_scale: float | Literal["auto"] = "auto",
        sparse_per_table: dict[str, dict[str, Any]] | None = None,
        sharding: dict[str, str | dict[str, Any]] | None = None,
        kernel_backend: Literal["auto", "torch", "fbgemm"] = "auto",
        comm_dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        init_shards: Literal["copy", "in_place"] = "copy",
        validate_inputs: bool = True,
        pipeline: bool = True,
        verify_replicas: int | Literal["checkpoint", "off"] | None = "checkpoint",
        memory_per_rank_gb: float | None = None,
        plan: str | None = None,
        planner_batch_size: int | None = None,
        allow_column_wise: bool = False,
        links: str | Any = "auto",
        lookup_stats: dict[str, dict[str, Any]] | Literal["auto"] | None = "auto",
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        options = build_options(type(self).__name__, locals(), kwargs, DDPStrategy)
        timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        super().__init__(options, process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method, **kwargs)
        self._backward_sync_control = _AccumulatingSyncControl(self)
        self._module: nn.Module | None = None
        self._optimizers: list[Optimizer] = []
        self._table_parameters: set[int] = set()
        self._loader_seen = False  # the first loader set up gives the planner's batch where nothing else does
        self._loader_batch: int | None = None  # its batch_size (None: a loader without one)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``twod_sparse`` (subprocess/torchrun), ``_spawn`` and ``_notebook`` (fork) with Fabric."""
        register_names(cls, strategy_registry)

    @override
    def _configure_launcher(self) -> None:
        self.check_before_launch()  # Fabric knows devices and nodes here, before any launch
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_groups_at_exit()

    # ------------------------------------------------------------------ model and optimizers
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Plan, shard the tables (a collective), then DDP over the dense rest (if there is one)."""
        with raise_on_every_rank(world_group()):
            self._check_precision(str(self.precision.precision))
        self._plan_mesh(module)
        before = dict(module.named_parameters())
        self._shard(module)
        after = {id(p) for p in module.parameters()}
        self._table_parameters = {id(p) for p in before.values() if id(p) not in after}
        for twin in self.sparse_modules.values():
            twin.register_forward_pre_hook(self._drain_before_evaluation)
        self._module = module
        if not any(p.requires_grad for p in module.parameters()):
            return module  # only embedding tables: nothing dense for DDP to average
        return super().setup_module(module)

    @override
    def plan_layout(self, module: nn.Module, budget: float, links, datamodule: Any = None,
                    **kwargs: Any) -> StrategyPlan:
        """The engine's plan, for the ``batch_size`` of the first loader set up (``fabric.setup_dataloaders``
        before ``fabric.setup``) where ``planner_batch_size`` and the module give none."""
        if datamodule is None and self._loader_batch is not None:
            datamodule = SimpleNamespace(batch_size=self._loader_batch)  # where batch_size_of reads it
        return super().plan_layout(module, budget, links, datamodule, **kwargs)

    @override
    def _sample_stats(self, module: nn.Module, datamodule: Any = None) -> tuple[str, str]:
        """None sampled: a Fabric loop's data is its own, not seen at ``fabric.setup``; ``lookup_stats`` as a
        mapping gives the statistics."""
        if self.options.lookup_stats is None:
            return "", ""
        return "", f"none sampled: Fabric sees no training data at set-up; {STATS_FIX}"

    @override
    def process_dataloader(self, dataloader):
        """Run the loader in step on every rank (``fabric.setup_dataloaders``): an uneven one stops on every
        rank together, and rank 0 warns with each rank's batch count. The first loader's batch is the
        planner's (``plan_layout``); set up after a plan made for another batch, rank 0 warns."""
        if not self._loader_seen:  # only its batch_size is kept: the loader may hold the whole dataset
            self._loader_seen = True
            self._loader_batch = getattr(dataloader, "batch_size", None)
            self._warn_if_planned_for_another_batch(self._loader_batch)
        return even_batches(super().process_dataloader(dataloader), world_group())

    def _warn_if_planned_for_another_batch(self, batch: int | None) -> None:
        report = self.sharding_plan.report if self.sharding_plan is not None else None
        if report is None or self.options.planner_batch_size is not None or batch in (None, report.batch_size):
            return
        rank_zero_warn(f"{type(self).__name__}: the plan was made at fabric.setup for batch {report.batch_size} per "
                       f"rank, but the loader set up after it gives {batch}: call fabric.setup_dataloaders before "
                       f"fabric.setup, or give planner_batch_size={batch}")

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Drop the tables' parameters (an optimizer built before the set-up holds them)."""
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if id(p) not in self._table_parameters]
            for p in group["params"]:
                if id(p) in self._table_parameters:
                    optimizer.state.pop(p, None)
            group["params"] = kept
        self._optimizers.append(optimizer)
        return optimizer

    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if not self._optimizers or optimizer is self._optimizers[0]:
            self.sparse_step()
        return output

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> NoReturn:
        """Refused (``fabric.clip_gradients(max_norm=...)``): see ``_refuse_clipping``."""
        self._refuse_clipping()

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> NoReturn:
        """Refused (``fabric.clip_gradients(clip_val=...)``): see ``_refuse_clipping``."""
        self._refuse_clipping()

    def _refuse_clipping(self) -> NoReturn:
        # the same on every rank (each calls it): no collective, so none is left waiting
        raise clipping_refused(type(self).__name__, "fabric.clip_gradients")

    def _drain_before_evaluation(self, twin: nn.Module, args) -> None:
        # the same on every rank, also one without shards: what the Trainer's drain at validation does
        owed = self.reducer is not None and (self.reducer.launched or self.reducer.residuals_owed)
        if not twin.training and (self.schedule.owed or owed):
            self.drain()

    # ------------------------------------------------------------------ checkpoints
    def _split_state(self, state: dict[str, Any]) -> tuple[str | None, list[str], dict[str, Any]]:
        """The key of the sharded model, the keys of the optimizers (in order), and the other entries."""
        model_key, optimizer_keys, rest = None, [], {}
        for key, value in state.items():
            value = _unwrapped(value)
            if value is self._module:
                model_key = key
            elif isinstance(value, Optimizer):
                optimizer_keys.append(key)
            else:
                rest[key] = value
        return model_key, optimizer_keys, rest

    @override
    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict | None = None) -> None:
        """Write the Trainer path's distributed checkpoint (a collective): the model and optimizers as
        DCP data, the other entries (state dicts of other stateful objects) beside them."""
        if storage_options is not None or filter:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        model_key, optimizer_keys, rest = self._split_state(state)
        if model_key is None:
            raise ValueError(f"{type(self).__name__}: the state to save must hold the model set up with this "
                             "strategy, e.g. fabric.save(path, {'model': model, 'optimizer': optimizer})")
        checkpoint = {key: value.state_dict() if hasattr(value, "state_dict") else value for key, value in rest.items()}
        checkpoint["fabric"] = {"model": model_key, "optimizers": optimizer_keys}
        checkpoint.setdefault("lr_schedulers", [])  # what the Trainer expects of a full checkpoint
        optimizers = [_unwrapped(state[key]) for key in optimizer_keys]
        self._save_sparse(path, checkpoint, self._module, optimizers)

    @override
    def load_checkpoint(self, path, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a distributed checkpoint of any mesh (written by Fabric or the Trainer) into the model,
        the optimizers (in order) and the other entries of ``state``; returns what was not restored.
        A single file of the unsharded model is read as Fabric reads it, its optimizer states mapped
        onto the dense parameters."""
        path = self.broadcast(str(path))
        state = {} if state is None else state
        if isinstance(state, (nn.Module, Optimizer)):
            raise TypeError(f"{type(self).__name__}.load_checkpoint needs a dict of the objects to restore, e.g. "
                            "fabric.load(path, {'model': model, 'optimizer': optimizer})")
        model_key, optimizer_keys, rest = self._split_state(state)
        if model_key is None:
            raise ValueError(f"{type(self).__name__}: the state to load into must hold the model set up with this "
                             "strategy, e.g. fabric.load(path, {'model': model, 'optimizer': optimizer})")
        optimizers = [_unwrapped(state[key]) for key in optimizer_keys]
        if self._check_readable(path):
            loaded = self._load_sparse(path, self._module, optimizers)
        else:
            loaded = self._load_single_file(path, model_key, optimizer_keys, optimizers, strict, weights_only)
        for key, value in rest.items():
            if key not in loaded:
                if strict:
                    raise KeyError(f"{type(self).__name__}: the checkpoint {path} has no entry {key!r}; "
                                   f"it holds {sorted(loaded)} (or load with strict=False)")
                continue
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(loaded.pop(key))
            else:
                state[key] = loaded.pop(key)
        return loaded

    def _load_single_file(self, path: str, model_key: str, optimizer_keys: list[str], optimizers: list,
                          strict: bool, weights_only: bool | None) -> dict[str, Any]:
        loaded = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        trainer_format = "state_dict" in loaded  # the Trainer's single file; else Fabric's
        self._module.load_state_dict(loaded.pop("state_dict" if trainer_format else model_key), strict=strict)
        states = loaded.pop("optimizer_states", []) if trainer_format else [loaded.pop(k) for k in optimizer_keys]
        self._load_unsharded_optimizers(states, optimizers, self._module)
        self._after_load()
        return loaded
