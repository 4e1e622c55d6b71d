"""NormalizedEntropy, AUC, Calibration and CTR are exact under distributed sync: 4 gloo processes with
uneven numbers of samples equal one process on the concatenated samples."""

from __future__ import annotations

import pytest
import torch

from lightning_twod.metrics import AUC, CTR, Calibration, NormalizedEntropy
from tests.helpers.distributed import run_distributed


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, generator=gen) * 3
    return logits, torch.bernoulli(torch.sigmoid(logits), generator=gen)


SIZES = [37, 120, 5, 64]  # uneven samples per rank


def _metrics(logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> dict[str, float]:
    """Every metric over ``chunk``-sized updates; ``compute()`` syncs when a process group is up."""
    metrics = {"ne": NormalizedEntropy(), "auc": AUC(), "calibration": Calibration(), "ctr": CTR()}
    for part in torch.arange(logits.numel()).split(chunk):
        for name, metric in metrics.items():
            if name == "ctr":
                metric.update(labels[part])
            else:
                metric.update(logits[part], labels[part])
    return {name: float(metric.compute()) for name, metric in metrics.items()}


def _sync_worker(rank: int, world_size: int) -> dict[str, float]:
    return _metrics(*_data(rank, SIZES[rank]), chunk=16)


def test_metrics_synced_over_ranks_equal_the_concatenated_data():
    results = run_distributed(_sync_worker, len(SIZES), timeout=120)
    parts = [_data(rank, n) for rank, n in enumerate(SIZES)]
    whole = _metrics(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), chunk=10_000)
    local = [_metrics(*p, chunk=16) for p in parts]
    for name in whole:
        assert max(abs(m[name] - whole[name]) for m in local) > 1e-3, f"ranks' own {name} differ from the global"
        for rank, synced in enumerate(results):
            assert synced[name] == pytest.approx(whole[name], rel=1e-6, abs=1e-7), (name, rank)
