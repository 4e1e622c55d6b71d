"""A DLRM whose ranks fail differently, for the CLI's error reports (``tests/system/test_cli_errors.py``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod.cli.errors import REPORTED
from lightning_twod.models.dlrm import DLRM

USER_ERROR = "the user's error: set data.init_args.batch_size"
BUG = "a_missing_key"


class FailingDLRM(DLRM):
    """Rank ``user_error_rank`` raises ``MisconfigurationException(USER_ERROR)``, every other rank
    ``KeyError(BUG)``, in ``where``: ``"training_step"`` (each rank on its own; the bug is raised once
    the user's error was reported in the job's store, or the store is gone with its rank) or
    ``"configure_optimizers"`` (inside the strategy's consensus, which joins the two)."""

    def __init__(self, table_rows: Sequence[int], num_dense: int, embedding_dim: int = 8,
                 bottom_mlp: Sequence[int] = (8,), top_mlp: Sequence[int] = (8,), user_error_rank: int = 0,
                 where: str = "training_step") -> None:
        super().__init__(table_rows=table_rows, num_dense=num_dense, embedding_dim=embedding_dim,
                         bottom_mlp=bottom_mlp, top_mlp=top_mlp)
        self.user_error_rank, self.where = user_error_rank, where

    def _fail(self) -> None:
        if self.global_rank == self.user_error_rank:
            raise MisconfigurationException(USER_ERROR)
        if self.where == "training_step":
            _wait_until_reported()
        raise KeyError(BUG)

    def configure_optimizers(self):
        if self.where == "configure_optimizers":
            self._fail()
        return super().configure_optimizers()

    def training_step(self, batch: dict, batch_idx: int):
        if self.where == "training_step":
            self._fail()
        return super().training_step(batch, batch_idx)


def _wait_until_reported(timeout_s: float = 60.0) -> None:
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([REPORTED]) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 (the store's host ended: it reported first)
        pass
