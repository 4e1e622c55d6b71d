"""A DataLoader whose place in the epoch goes into the checkpoint, so a run resumed mid-epoch reads
exactly the batches the uninterrupted run would have read (``ResumableLoader``).

Lightning saves ``state_dict()`` of a training loader that has ``state_dict`` and
``load_state_dict`` with the fit loop, and gives it back to ``load_state_dict`` before the resumed
run calls ``iter`` (a loader with a length, as this one, is not read ahead by the fit loop, so the
batches handed out are the batches trained on). The state: the epoch, the batches of it handed out,
and what the order depends on (ranks, workers, batch size, shuffle, seed); resuming mid-epoch with
another of those is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.utils.data import DataLoader

from lightning_twod.datasets.criteo_prepared import CriteoPrepared

_ORDER = ("world_size", "num_workers", "batch_size", "shuffle", "seed")


class ResumableLoader(DataLoader):
    """``DataLoader(dataset, batch_size=None, num_workers=num_workers)`` over a ``CriteoPrepared`` that
    saves and restores its place (module doc).

    ``epoch``: the current epoch when iteration begins (the datamodule passes the Trainer's
    ``current_epoch``); without it each ``iter`` starts the next epoch, counted from 0.
    """

    def __init__(self, dataset: CriteoPrepared, num_workers: int = 0,
                 epoch: Callable[[], int | None] | None = None) -> None:
        super().__init__(dataset, batch_size=None, num_workers=num_workers)
        self._epoch_of = epoch
        self._epoch, self._handed_out, self._loaded = -1, 0, None

    def _order(self) -> dict:
        data = self.dataset
        return {"world_size": data.world_size, "num_workers": self.num_workers, "batch_size": data.batch_size,
                "shuffle": data.shuffle, "seed": data.seed}

    def __iter__(self) -> Iterator:
        epoch = self._epoch_of() if self._epoch_of is not None else None
        if epoch is None:
            epoch = self._loaded["epoch"] if self._loaded else self._epoch + 1
        start = self._loaded["batches"] if self._loaded and self._loaded["epoch"] == epoch else 0
        self._loaded = None
        self.dataset.epoch, self.dataset.start = epoch, start
        self._epoch, self._handed_out = epoch, start
        for batch in super().__iter__():
            self._handed_out += 1
            yield batch

    def state_dict(self) -> dict:
        """``{"epoch", "batches"}`` (handed out in that epoch) and the settings the order depends on."""
        return {"epoch": self._epoch, "batches": self._handed_out, **self._order()}

    def load_state_dict(self, state: dict) -> None:
        """Resume where ``state`` was taken: the next ``iter`` of its epoch skips the batches handed out."""
        epoch, batches = state["epoch"], state["batches"]
        if batches >= len(self):  # saved at the end of an epoch: the next one starts from its beginning
            epoch, batches = epoch + 1, 0
        changed = {k: (state[k], v) for k, v in self._order().items() if k in state and state[k] != v}
        if batches and changed:
            said = ", ".join(f"{k}={was} then, {now} now" for k, (was, now) in changed.items())
            raise ValueError(f"CriteoDataModule: cannot resume mid-epoch {epoch} (after {batches} batches) with "
                             f"another batch order ({said}): resume with the same settings, or from a checkpoint "
                             "taken at the end of an epoch")
        self._loaded = {"epoch": epoch, "batches": batches}
