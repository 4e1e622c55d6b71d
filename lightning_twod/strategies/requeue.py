"""SLURM's requeue signal, acted on where every rank is at the same point of training.

Lightning's SLURM connector (``SLURMEnvironment(auto_requeue=True)``, its default) answers the
requeue signal (``--signal=USR1@SECONDS``) inside the signal handler: it saves
``hpc_ckpt_N.ckpt`` in ``default_root_dir`` with ``trainer.save_checkpoint``, then rank 0 calls
``scontrol requeue``. Under the 2D strategy that save is a distributed checkpoint, a collective (a
reduction, then every rank writes its shards): run from a handler, each rank would enter it at
whatever point of its step the signal found it, in the middle of another collective. So here the
handler only notes the signal; after each optimizer step (the last batch of an accumulation, so a
save never drops accumulated gradients and a resumed run starts from the state at the signal) the
ranks agree whether any of them got it, and if so every rank runs Lightning's handler there, at the
same batch. A requeued job finds that checkpoint by Lightning's rule (``ckpt_path=None`` under
SLURM, or ``"hpc"``), or by its path.

Cost: one all-reduce of one integer per optimizer step, over a CPU (gloo) process group made once
at train start: no GPU work and no GPU-to-host synchronization; tens to hundreds of microseconds of
TCP round trip on the host. It runs only under SLURM with Lightning's automatic requeue.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment


class RequeueAtBatchEnd(pl.Callback):
    """Defers Lightning's SLURM requeue handler to the end of an optimizer step, on every rank at once."""

    def __init__(self) -> None:
        self._handler: Any = None  # Lightning's, while this callback holds the signal
        self._signal: int | None = None
        self._received = False
        self._group: Any = None  # the CPU group the ranks agree over (None: one process)

    @staticmethod
    def install(trainer: pl.Trainer) -> None:
        """Add the callback to ``trainer`` (once) where Lightning requeues a SLURM job on its signal."""
        environment = trainer.strategy.cluster_environment
        if (isinstance(environment, SLURMEnvironment) and environment.auto_requeue
                and not any(isinstance(c, RequeueAtBatchEnd) for c in trainer.callbacks)):
            trainer.callbacks.append(RequeueAtBatchEnd())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers its handler before training starts and restores the previous one at its end
        self._signal = int(trainer.strategy.cluster_environment.requeue_signal)
        handler = signal.getsignal(self._signal)
        main = threading.current_thread() is threading.main_thread()  # where Lightning registers it too
        self._handler = handler if callable(handler) and main else None
        self._received = False
        if self._handler is not None:
            signal.signal(self._signal, self._note)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # a collective: every rank runs this hook

    def _note(self, signum: int, frame: Any) -> None:
        self._received = True

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # the same on every rank: the accumulation count and whether Lightning registered its handler
        if self._handler is None or trainer.fit_loop._should_accumulate():
            return
        if self._any_received():
            self._received = False
            self._handler(self._signal, None)  # save through the strategy (a collective), rank 0 requeues

    def _any_received(self) -> bool:
        """Whether any rank noted the signal: one all-reduce of an integer over the CPU group."""
        if self._group is None:
            return self._received
        flag = torch.tensor([int(self._received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._handler is not None and signal.getsignal(self._signal) == self._note:
            signal.signal(self._signal, self._handler)
        self._handler = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
