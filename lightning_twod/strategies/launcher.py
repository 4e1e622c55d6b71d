"""Lightning's launchers, checking the model against the strategy's options before any process starts.

Both check first, in the launching process, what the model the Trainer is about to run decides
(``TwoDSparseEngine.check_before_launch``: a ``sharding`` entry for a table the model does not
have). The spawn/fork launcher also brings the training progress back to the main process:
Lightning's multiprocessing launcher returns rank 0's ``state_dict`` (for a sharded model: the
full tables, assembled by a collective on every rank) and the trainer state, but not the loop
progress, so ``trainer.global_step`` would read 0 in the main process after ``fit``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override


class _ChecksTheModelFirst:
    """Mixed into a Lightning launcher: ``launch`` checks the Trainer's model with the strategy first."""

    _strategy: Any

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.lightning_module is not None:
            self._strategy.check_before_launch(trainer.lightning_module)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class TwoDSubprocessScriptLauncher(_ChecksTheModelFirst, _SubprocessScriptLauncher):
    """Lightning's subprocess launcher (``start_method="popen"``) for ``strategy``."""

    def __init__(self, strategy: Any, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy


class TwoDMultiProcessingLauncher(_ChecksTheModelFirst, _MultiProcessingLauncher):
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
