"""Spawn/fork launcher that also brings the training progress back to the main process.

Lightning's multiprocessing launcher returns rank 0's ``state_dict`` (for a sharded model: the
full tables, assembled by a collective on every rank) and the trainer state, but not the loop
progress, so ``trainer.global_step`` would read 0 in the main process after ``fit``.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from typing_extensions import override


class TwoDMultiProcessingLauncher(_MultiProcessingLauncher):
    @override
    def get_extra_results(self, trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        buffer = io.BytesIO()
        torch.save(trainer.fit_loop.state_dict(), buffer)
        extra["fit_loop_bytes"] = buffer.getvalue()
        return extra

    @override
    def update_main_process_results(self, trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if "fit_loop_bytes" in extra:
            # bytes from a worker process: read as weights only, as Lightning reads its callback metrics
            # (and as a resume reads the same loop state from trainer_state.pt)
            state = torch.load(io.BytesIO(extra["fit_loop_bytes"]), weights_only=True)
            trainer.fit_loop.load_state_dict(state)
