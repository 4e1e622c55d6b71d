"""``TwoDSparseStrategy``: 2D sparse parallelism as a Lightning Trainer strategy (Lightning glue only).

The 2D engine (plan, twins, sparse step, reductions, checkpoints) is ``engine.py``'s
``TwoDSparseEngine``, shared with the Fabric strategy (``fabric.py``); the constructor checks the 2D
options into one ``options.TwoDOptions`` and hands it to the engine. Set-up order, on every rank:

1. process group (Lightning's DDP set-up: subprocess, spawn/fork, torchrun or SLURM); then, after the
   LightningModule's ``configure_model`` (where tables may be built), the plan and the 2D mesh:
   ``world = replicas x shard_group_size`` (``core.mesh.SparseParallelDims``);
2. every embedding module of the LightningModule is swapped for its sharded twin;
3. the dense rest is wrapped in DDP over the whole world, and the user's ``configure_optimizers``
   sees only dense parameters.

One training step (``optimizer_step``), in this order:

1. forward and backward (the closure): ids go to their owners inside the shard group, pooled
   vectors come back; backward returns gradients to the owners, scaled by ``1 / shard_group_size``
   so that each copy gets the gradient of its group's mean loss; DDP averages dense gradients.
   With ``pipeline=True`` this batch's ids left during the previous step, and the next batch's
   leave after this forward (``sparse/pipeline.py``; the next batch: ``lookahead.py``);
2. the user's dense optimizer step;
3. the sparse step: FBGEMM kernels already updated their rows in backward where it was the step's
   only one (else, as under gradient accumulation, they apply the summed gradients now); torch
   kernels apply the sparse optimizer now (``sync_mode="gradients"``: after averaging the touched
   rows' gradients over the replica axis);
4. every ``sync_interval`` steps (``sync_mode="weights"``), the cross-group reduction averages the
   touched rows' weights and optimizer state over the replica axis (``replication``); with
   ``sync_overlap`` it is launched here and applied when the next one is due.

Validation, test, predict, every checkpoint and the end of fit first ``drain()``; checkpoints and the
end of fit then check that every copy is identical (``verify_replicas``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer
from typing_extensions import override

from lightning_twod.checkpoint.directory import is_distributed_checkpoint
from lightning_twod.checkpoint.tables import dense_state_dict
from lightning_twod.core.mesh import AUTO_GROUP_SIZE
from lightning_twod.distributed import destroy_process_groups_at_exit
from lightning_twod.distributed.consensus import raise_on_every_rank
from lightning_twod.sparse.pipeline import InputPipeline
from lightning_twod.strategies import lookahead
from lightning_twod.strategies.callbacks import TwoDModelSummary
from lightning_twod.strategies.engine import TwoDSparseEngine, clipping_refused
from lightning_twod.strategies.even_batches import even_batches
from lightning_twod.strategies.launcher import TwoDMultiProcessingLauncher, TwoDSubprocessScriptLauncher
from lightning_twod.strategies.options import build_options, strategy_docstring
from lightning_twod.strategies.planning import world_group
from lightning_twod.strategies.quiet import quiet_lightning
from lightning_twod.strategies.registration import register_names
from lightning_twod.strategies.requeue import RequeueAtBatchEnd

quiet_lightning()  # nothing the user cannot act on (strategies/quiet.py)


class TwoDSparseStrategy(TwoDSparseEngine, DDPStrategy):
    __doc__ = strategy_docstring(
        "Shards embedding tables inside groups of ``shard_group_size`` ranks; the groups are replicas.")

    strategy_name = "twod_sparse"

    def __init__(
        self,
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
        self._loaded_distributed = False
        self.input_pipeline: InputPipeline | None = None

    # ------------------------------------------------------------------ registry and launch
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``twod_sparse`` (subprocess/torchrun), ``_spawn`` and ``_notebook`` (fork)."""
        register_names(cls, strategy_registry)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.check_before_launch()  # called once the Trainer knows devices and nodes; the launcher checks the model
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = TwoDSubprocessScriptLauncher(self, self.cluster_environment, self.num_processes,
                                                              self.num_nodes)
        else:
            self._launcher = TwoDMultiProcessingLauncher(self, start_method=self._start_method)

    # ------------------------------------------------------------------ set-up
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_groups_at_exit()

    @override
    def setup(self, trainer) -> None:
        """Plan and shard the tables, then Lightning's DDP set-up. Lightning calls this after the
        LightningModule's ``configure_model``, so tables built there are planned too."""
        model = self.lightning_module
        if model is None:
            raise MisconfigurationException(f"{type(self).__name__}: no LightningModule to shard")
        with raise_on_every_rank(world_group()):  # before the plan: a refused run measures no links
            self._check_precision(str(self.precision_plugin.precision))
            self._check_trainer(trainer)
        self._plan_mesh(model)
        self._shard(model)
        TwoDModelSummary.install(trainer)  # Lightning's summary would miss the rows the twins hold
        RequeueAtBatchEnd.install(trainer)  # SLURM's requeue signal: saved after an optimizer step, every rank at once
        super().setup(trainer)
        if self.options.pipeline and trainer.state.fn == TrainerFn.FITTING and self.world_size > 1:
            groups = {size: mesh.duplicate(self.collective_timeout)  # a collective
                      for size, mesh in self._groups_of_size.items()}
            self.input_pipeline = InputPipeline(self.sparse_modules, groups, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.input_pipeline is not None:  # a job in flight may wait on a failed peer: do not join it
            self.input_pipeline.close(timeout=0)
            self.input_pipeline = None
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self.input_pipeline is not None:
            self.input_pipeline.close()
            self.input_pipeline = None
        super().teardown()

    @override
    def setup_optimizers(self, trainer) -> None:
        with raise_on_every_rank(world_group()):  # the user's configure_optimizers may fail on one rank
            super().setup_optimizers(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every stage's loader, run in step on every rank: an uneven one stops on every rank together
        (rank 0 warns with each rank's batch count; ``predict`` raises on every rank instead)."""
        state = self.lightning_module.trainer.state
        what = f"{state.stage.dataloader_prefix} dataloader" if state.stage else "dataloader"
        return even_batches(super().process_dataloader(dataloader), world_group(), what,
                            strict=state.fn == TrainerFn.PREDICTING)

    def _check_trainer(self, trainer) -> None:
        name = type(self).__name__
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.gradient_clip_val:
            raise clipping_refused(name, "gradient_clip_val")
        self._refuse_module_clipping()

    def _refuse_module_clipping(self) -> None:
        """``LightningModule.clip_gradients`` (manual optimization, or a ``configure_gradient_clipping`` of
        the module's own) goes to the precision plugin, not to the strategy: the plugin's clipping is
        refused as ``gradient_clip_val`` is, when it would clip (``clip_val > 0``)."""
        plugin = self.precision_plugin
        if getattr(plugin.clip_gradients, "refused_by", None) is self:
            return
        clip = plugin.clip_gradients

        def clip_gradients(optimizer, clip_val=0.0, *args: Any, **kwargs: Any) -> None:
            if clip_val and clip_val > 0:  # the same on every rank (each calls it): no collective waits
                raise clipping_refused(type(self).__name__, "self.clip_gradients")
            return clip(optimizer, clip_val, *args, **kwargs)

        clip_gradients.refused_by = self
        plugin.clip_gradients = clip_gradients

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

    # ------------------------------------------------------------------ training step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's step; with the input pipeline, the next batch's ids leave after its forward."""
        pipeline = self.input_pipeline
        if pipeline is None:
            return super().training_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        pipeline.begin_step(args[0] if args else None, lookahead.position(trainer))
        output = super().training_step(*args, **kwargs)
        pipeline.end_step(*(lookahead.next_batch(trainer) or (None, None)))
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's gradient accumulation: the sparse gradients are summed too, until the optimizer step."""
        with self.accumulating(), super().block_backward_sync():
            yield

    @override
    def on_train_start(self) -> None:
        # Manual optimization: the user's backwards and steps; each step's sparse gradients are summed first.
        self.begin_sparse_steps(manual=not self.lightning_module.automatic_optimization)
        super().on_train_start()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if not self.optimizers or optimizer is self.optimizers[0]:
            self.sparse_step()
        return output

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
        self._drain_and_verify()  # leave training with identical copies, also after an unfinished interval
        super().on_train_end()

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards and optimizers must exist: checkpoints load into them in place

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Dense part only; save_checkpoint writes the tables sharded (no gathering on any rank).
        return dense_state_dict(self.lightning_module, self.sparse_modules)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # Nothing gathered here: save_checkpoint writes every optimizer's state itself (a ZeRO optimizer's
        # consolidated there, once: checkpoint.optimizer.state_to_save).
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write a distributed checkpoint directory (see ``lightning_twod.checkpoint.distributed``); a collective.

        An unfinished interval's reduction completes first, so the checkpoint holds the rows every
        copy agrees on (and a resumed run continues exactly as this one does).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        self._save_sparse(filepath, checkpoint, self.lightning_module, self.optimizers)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a distributed checkpoint from any mesh, or a single-file one of the unsharded model."""
        path = self.broadcast(str(checkpoint_path))
        self._loaded_distributed = self._check_readable(path)
        if self._loaded_distributed:
            return self._load_sparse(path, self.lightning_module, self.optimizers)
        state = super().load_checkpoint(path, weights_only=weights_only)
        self.schedule.steps = int(state.get("global_step", 0))
        return state

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self._loaded_distributed:  # a single-file checkpoint: full tables, sliced by each twin
            super().load_model_state_dict(checkpoint, strict=strict)
            self._after_load()

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not self._loaded_distributed:
            self._load_unsharded_optimizers(checkpoint["optimizer_states"], self.optimizers, self.lightning_module)

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero and is_distributed_checkpoint(filepath):
            shutil.rmtree(filepath)
        elif not is_distributed_checkpoint(filepath):
            super().remove_checkpoint(filepath)
