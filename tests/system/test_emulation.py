"""The single-process emulator of the strategy's arithmetic (used by the quality benchmark)
against real 4-process runs of ``TwoDSparseStrategy``: same weights after several steps."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

STEPS = 6
LR = 0.2
RUNS = {
    "weights_2x2_interval_2": dict(shard_group_size=2, sync_mode="weights", sync_interval=2,
                                   sparse=("rowwise_adagrad", 0.05, 1e-3, 1.0)),
    "weights_4x1_momentum": dict(shard_group_size=1, sync_mode="weights", sync_interval=1,
                                 sparse=("momentum_rowwise_adagrad", 0.05, 1e-3, 4.0)),
    "gradients_2x2": dict(shard_group_size=2, sync_mode="gradients", sync_interval=1,
                          sparse=("rowwise_adagrad", 0.05, 1e-3, 1.0)),
}


def _worker(rank: int, world_size: int, port: int) -> dict:
    C.as_external_rank(rank, world_size, port)
    out = {}
    for name, run in RUNS.items():
        kind, lr, eps, scale = run["sparse"]
        lit = C.LitDLRM(C.make_net("collection"), LR, num_samples=STEPS * C.WORLD * C.LOCAL_BATCH)
        strategy = TwoDSparseStrategy(shard_group_size=run["shard_group_size"], sync_mode=run["sync_mode"],
                                      sync_interval=run["sync_interval"], sparse_optimizer=kind, sparse_lr=lr,
                                      sparse_eps=eps, momentum_scale=scale, kernel_backend="torch")
        trainer = pl.Trainer(devices=world_size, strategy=strategy, **C.trainer_kwargs(STEPS))
        trainer.fit(lit)
        out[name] = C.numpy_state(lit.net.state_dict())
    return out


@pytest.fixture(scope="module")
def real_runs() -> dict:
    return run_distributed(_worker, C.WORLD, C.free_port(), timeout=300)[0]


@pytest.mark.parametrize("name", list(RUNS))
def test_emulator_matches_real_runs(real_runs, name):
    run = RUNS[name]
    kind, lr, eps, scale = run["sparse"]
    net = C.make_net("collection")
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    layout = EmulatedLayout(C.WORLD, run["shard_group_size"], run["sync_mode"], run["sync_interval"])
    emulator = MeshEmulator(net, layout, SparseOptimizerConfig(kind, lr, eps, scale),
                            loss_fn=lambda model, batch: model.loss(batch),
                            dense_optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    dataset = C.ClickDataset(STEPS * C.WORLD * C.LOCAL_BATCH)
    for step in range(STEPS):
        start = step * C.WORLD * C.LOCAL_BATCH
        # rank r's samples under the tests' sequential DistributedSampler: r, r + W, r + 2W, ...
        emulator.step([C.collate([dataset[start + r + C.WORLD * i] for i in range(C.LOCAL_BATCH)])
                       for r in range(C.WORLD)])
    emulator.drain()  # the strategy's end of fit
    got = net.state_dict()
    for key, want in real_runs[name].items():
        torch.testing.assert_close(got[key], torch.as_tensor(want), atol=1e-5, rtol=1e-5, msg=key)
        assert not torch.equal(got[key], initial[key]), f"{key} did not train"
