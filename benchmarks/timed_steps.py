"""The phase timing of a Lightning training step, shared by the Lightning workers of the benchmarks.

``TimedSteps`` is a LightningModule mixin: the step's forward, backward and optimizer phases go to
``self.timer`` (``lightning_twod.sparse.timing.PhaseTimer``), and each step's start and end to
``self.clock`` (``workload.StepClock`` or ``scaling_workers.Window``: ``step_begin`` / ``step_end``).
The model's ``forward(batch)`` returns logits ``[B]``; the loss is BCE against ``batch["label"]``.
"""

from __future__ import annotations

import torch.nn.functional as F


class TimedSteps:
    timer = None
    clock = None

    def training_step(self, batch, batch_idx):
        with self.timer.phase("forward"):
            return F.binary_cross_entropy_with_logits(self(batch), batch["label"])

    def on_train_batch_start(self, batch, batch_idx):
        self.clock.step_begin(batch_idx)

    def on_before_backward(self, loss):
        self.timer.start("backward")

    def on_after_backward(self):
        self.timer.stop("backward")
        self.timer.start("optimizer")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.timer.stop("optimizer")
        self.clock.step_end(batch_idx)
        self.last_loss = float(outputs["loss"])
