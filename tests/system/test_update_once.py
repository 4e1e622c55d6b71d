"""The sparse update happens once per optimizer step, from the gradient summed over every backward and
every lookup of the step, whatever the kernel (FBGEMM fused or torch) and the launcher.

Oracle: the same training with one lookup and one backward per step on the whole batch and the torch
kernels (one update from the summed gradient). Each pattern below splits that step differently:
Lightning's gradient accumulation, manual optimization with two backwards, a collection looked up
twice, Fabric's ``no_backward_sync`` accumulation. A Fabric loop that makes a second backward after
FBGEMM has updated the rows, outside ``no_backward_sync``, is refused on every rank.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod import TwoDSparseFabricStrategy, TwoDSparseStrategy
from lightning_twod.sparse.kernels import fbgemm_available
from lightning_twod.sparse.update_once import UpdateOnceError
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

#: The kernels the worker trains with: the torch patterns run without FBGEMM too.
BACKENDS = ("torch", "fbgemm") if fbgemm_available() else ("torch",)
needs_fbgemm = pytest.mark.skipif("fbgemm" not in BACKENDS, reason="fbgemm_gpu is not installed")
BACKEND_CASES = ["torch", pytest.param("fbgemm", marks=needs_fbgemm)]

STEPS = 4
LR = 0.1
OPTIONS = dict(shard_group_size=2, sparse_optimizer="rowwise_adagrad", sparse_lr=0.05, sparse_eps=1e-3)


class TwiceLooked(C.LitDLRM):
    """Reads its collection twice a step and averages the two: the gradient of one lookup."""

    def training_step(self, batch, batch_idx):
        net = self.net
        dense = torch.relu(net.bottom(batch["dense"]))
        first, second = net.sparse(batch["sparse"]).values(), net.sparse(batch["sparse"]).values()
        logits = net.top(torch.cat([dense, (first + second) / 2], dim=1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["y"])


class TwoBackwards(C.LitDLRM):
    """Manual optimization: two forwards and backwards of half the loss, then one step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        for _ in range(2):
            self.manual_backward(self.net.loss(batch) / 2)
        optimizer.step()
        optimizer.zero_grad()


def _tables(lit) -> dict:
    state = lit.state_dict()
    return C.numpy_state({k: v for k, v in state.items() if "sparse" in k})


def _trainer(cls, backend: str, batch: int, **trainer_extra) -> dict:
    lit = cls(C.make_net("collection"), LR, batch_size=batch, num_samples=STEPS * C.WORLD * 8)
    strategy = TwoDSparseStrategy(kernel_backend=backend, **OPTIONS)
    pl.Trainer(devices=C.WORLD, strategy=strategy, **C.trainer_kwargs(STEPS, **trainer_extra)).fit(lit)
    return _tables(lit)


def _fabric(rank: int, backend: str, micro: int, *, no_sync: bool = True) -> dict:
    """``micro`` backwards of ``8 / micro`` samples each per optimizer step."""
    fabric = Fabric(accelerator="cpu", devices=C.WORLD,
                    strategy=TwoDSparseFabricStrategy(kernel_backend=backend, **OPTIONS))
    fabric.launch()
    lit = C.LitDLRM(C.make_net("collection"), LR)
    model, optimizer = fabric.setup(lit, lit.configure_optimizers())
    dataset = C.ClickDataset(STEPS * C.WORLD * 8)
    loader = DataLoader(dataset, batch_size=8 // micro, collate_fn=C.collate,
                        sampler=DistributedSampler(dataset, C.WORLD, rank, shuffle=False))
    for index, batch in enumerate(loader):
        last = (index + 1) % micro == 0
        with fabric.no_backward_sync(model, enabled=no_sync and not last):
            fabric.backward(model.training_step(batch, index) / micro)
        if last:
            optimizer.step()
            optimizer.zero_grad()
    return _tables(lit)


def _worker(rank: int, world_size: int, port: int) -> dict:
    C.as_external_rank(rank, world_size, port)
    out = {"oracle": _trainer(C.LitDLRM, "torch", 8)}
    for backend in BACKENDS:
        out[f"plain {backend}"] = _trainer(C.LitDLRM, backend, 8)
        out[f"accumulate {backend}"] = _trainer(C.LitDLRM, backend, 4, accumulate_grad_batches=2)
        out[f"two backwards {backend}"] = _trainer(TwoBackwards, backend, 8)
        out[f"looked up twice {backend}"] = _trainer(TwiceLooked, backend, 8)
        out[f"fabric accumulate {backend}"] = _fabric(rank, backend, 2)
    out["fabric plain torch"] = _fabric(rank, "torch", 1)
    if "fbgemm" in BACKENDS:
        try:
            _fabric(rank, "fbgemm", 2, no_sync=False)
            out["refused"] = None
        except UpdateOnceError as err:
            out["refused"] = str(err)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, C.WORLD, C.free_port(), timeout=420)


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    for key in want:
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(want[key]), atol=2e-5, rtol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("backend", BACKEND_CASES)
@pytest.mark.parametrize("pattern", ["plain", "accumulate", "two backwards", "looked up twice"])
def test_one_update_per_optimizer_step_under_the_trainer(results, pattern, backend):
    for rank in results:
        _close(rank[f"{pattern} {backend}"], rank["oracle"])
    # the rows were trained: the oracle is not the initial model
    initial = _tables(C.LitDLRM(C.make_net("collection"), LR))
    assert any((initial[k] != v).any() for k, v in results[0]["oracle"].items())


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_one_update_per_optimizer_step_under_fabric_accumulation(results, backend):
    for rank in results:
        _close(rank[f"fabric accumulate {backend}"], rank["fabric plain torch"])


@needs_fbgemm
def test_a_second_fused_backward_outside_no_backward_sync_is_refused_on_every_rank(results):
    for rank in results:
        assert rank["refused"] is not None
        assert "no_backward_sync" in rank["refused"] and "kernel_backend='torch'" in rank["refused"]
