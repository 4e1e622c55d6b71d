"""A drain in the middle of a gradient accumulation keeps the copies identical.

Validation every third batch (``val_check_interval=3``) with ``accumulate_grad_batches=2`` drains
between the two backwards of every other step, with a reduction owed (``sync_interval=3``): the
round takes the touched-row marks while the step's gradients still wait (held by FBGEMM kernels,
in ``.grad`` for torch ones). The rows they will change must be marked again, or the next round
skips them and the copies part (the check at the end of fit, ``verify_replicas="checkpoint"``,
raises ``ReplicaMismatchError``). Oracle: the copies are bit-identical at the end of fit (the
strategy's own digest check, and an all-gather here).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_twod import TwoDSparseStrategy
from lightning_twod.sparse.kernels import fbgemm_available
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

STEPS = 6
ROW_SCALE = 50  # tables of thousands of rows: a round sends the touched rows, not whole shards
BACKENDS = ["torch", "fbgemm"] if fbgemm_available() else ["torch"]


class Validated(C.LitDLRM):
    def validation_step(self, batch, batch_idx):
        return self.net.loss(batch)

    def val_dataloader(self):
        return DataLoader(C.ClickDataset(8, seed=1), batch_size=C.LOCAL_BATCH, collate_fn=C.collate)


def _fit(backend: str) -> list[bool]:
    lit = Validated(C.make_net("collection", row_scale=ROW_SCALE), 0.1,
                    num_samples=STEPS * 2 * C.WORLD * C.LOCAL_BATCH, row_scale=ROW_SCALE)
    strategy = TwoDSparseStrategy(shard_group_size=2, sync_interval=3, kernel_backend=backend,
                                  sparse_optimizer="rowwise_adagrad", sparse_lr=0.05)
    trainer = pl.Trainer(devices=C.WORLD, strategy=strategy, accumulate_grad_batches=2,
                         **C.trainer_kwargs(STEPS, val_check_interval=3, limit_val_batches=1))
    trainer.fit(lit)  # its end checks the copies by digest and raises if they parted
    assert trainer.global_step == STEPS
    return C.replicas_identical(strategy)


def _worker(rank: int, world_size: int, port: int) -> dict:
    C.as_external_rank(rank, world_size, port)
    return {backend: _fit(backend) for backend in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_between_the_backwards_of_a_step_keeps_the_copies_identical(backend):
    for result in run_distributed(_worker, C.WORLD, C.free_port(), timeout=300):
        assert result[backend] and all(result[backend])
