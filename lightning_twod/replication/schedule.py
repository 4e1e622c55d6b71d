"""When the copies of the replicated tables are reduced, counted in optimizer steps.

``SyncSchedule`` holds the counters and the rules, without Lightning and without collectives; its
user runs the rounds and reports them. The strategies' engine (Trainer and Fabric) and the
emulator (``testing.emulator``) drive it the same way::

    due = schedule.step()            # after every optimizer step of the tables
    if due:                          # sync_interval steps since the last round
        reduce(wait=schedule.waits())  # blocking, or launched (sync_overlap), then schedule.restart()
    ...
    if schedule.owed:                # drain (validation, checkpoints, the end of fit): reduce what is left
        reduce(wait=True)

A round that left every copy identical (a blocking one, or with ``sync_mode="gradients"`` every step)
is counted by ``completed``, which says when ``verify_replicas=N`` checks the copies: after every
N-th.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncSchedule:
    """The reduction schedule of one run.

    ``interval``: optimizer steps between rounds (``sync_interval``); ``overlap``: a round due is
    launched in the background and applied when the next is due (``sync_overlap``); ``rounds``:
    whether there are copies that rounds reduce (``sync_mode="weights"`` with replicated tables);
    ``verify_every``: the copies are checked identical after every N-th completed round (None: never).
    """

    interval: int = 1
    overlap: bool = False
    rounds: bool = False
    verify_every: int | None = None
    steps: int = 0
    """Optimizer steps of the tables so far (restored from a checkpoint)."""
    pending: int = 0
    """Steps since the last round was run or launched."""
    reductions: int = 0
    """Rounds that left every copy identical."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"sync_interval={self.interval}; use an integer >= 1")
        if self.verify_every is not None and self.verify_every < 1:
            raise ValueError(f"verify_replicas={self.verify_every}; use an integer >= 1")

    def step(self) -> bool:
        """Count an optimizer step; whether a round is due now (its runner then calls ``restart``)."""
        self.steps += 1
        if not self.rounds:
            return False
        self.pending += 1
        return self.pending == self.interval

    def waits(self, wait: bool | None = None) -> bool:
        """Whether a round blocks until applied: ``wait`` if given, else unless ``overlap``."""
        return not self.overlap if wait is None else wait

    def restart(self) -> None:
        """A round was run or launched, or the copies were overwritten together (a checkpoint load):
        the interval starts again."""
        self.pending = 0

    @property
    def owed(self) -> bool:
        """Whether steps since the last round are left to reduce (a drain reduces them)."""
        return self.pending > 0

    def completed(self) -> bool:
        """Count a round that left every copy identical; whether this one is to be verified."""
        self.reductions += 1
        return self.verify_every is not None and self.reductions % self.verify_every == 0
