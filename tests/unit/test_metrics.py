"""NormalizedEntropy, AUC, Calibration and CTR on one process: closed forms, ties, large scores
(their distributed sync: ``tests/system/test_metrics.py``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_twod.metrics import AUC, CTR, Calibration, NormalizedEntropy, binary_auc


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    """Brute force: over all (positive, negative) pairs, 1 if the positive scores higher, 1/2 if tied."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_count_with_ties():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (200,), generator=gen).float()  # many ties
    labels = (torch.rand(200, generator=gen) < 0.2 + 0.1 * scores).long()
    expected = _pairwise_auc(scores.tolist(), labels.tolist())
    assert binary_auc(scores, labels).item() == pytest.approx(expected, abs=1e-12)
    metric = AUC()
    for chunk in range(0, 200, 64):  # several updates
        metric.update(scores[chunk:chunk + 64], labels[chunk:chunk + 64])
    assert metric.compute().item() == pytest.approx(expected, abs=1e-6)


def test_auc_keeps_the_order_of_large_scores():
    # Counts or large logits must not be squashed into ties (as a sigmoid in float32 would).
    scores = torch.tensor([50.0, 60.0, 70.0, 80.0, 90.0, 100.0])
    labels = torch.tensor([0, 0, 1, 0, 1, 1])
    metric = AUC()
    metric.update(scores, labels)
    assert metric.compute().item() == pytest.approx(_pairwise_auc(scores.tolist(), labels.tolist()))
    assert metric.compute().item() == pytest.approx(8 / 9)


def test_auc_of_one_class_is_nan():
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.7]), torch.tensor([1, 1])).item())


def test_normalized_entropy_closed_form():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1000, generator=gen) * 2
    labels = torch.bernoulli(torch.sigmoid(logits), generator=gen)
    p = labels.double().mean()
    entropy = -(p * p.log() + (1 - p) * (1 - p).log())
    expected = F.binary_cross_entropy_with_logits(logits.double(), labels.double()) / entropy
    metric = NormalizedEntropy()
    metric.update(logits[:300], labels[:300])
    metric.update(logits[300:], labels[300:])
    assert metric.compute().item() == pytest.approx(expected.item(), rel=1e-5)
    assert metric.compute().item() < 0.9, "informative logits beat the base rate"

    from_probs = NormalizedEntropy(from_logits=False)
    from_probs.update(torch.sigmoid(logits.double()), labels)
    assert from_probs.compute().item() == pytest.approx(expected.item(), rel=1e-4)


def test_predicting_the_base_rate_gives_ne_one():
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    rate = labels.mean()
    metric = NormalizedEntropy(from_logits=False)
    metric.update(torch.full_like(labels, rate), labels)
    assert metric.compute().item() == pytest.approx(1.0, rel=1e-6)
    constant = NormalizedEntropy()
    constant.update(torch.zeros(5), labels)  # logit 0 = probability 1/2, worse than the base rate
    assert constant.compute().item() > 1.0
    single_class = NormalizedEntropy()
    single_class.update(torch.zeros(3), torch.ones(3))
    assert math.isnan(single_class.compute().item())


def test_calibration_and_ctr_closed_forms():
    logits = torch.tensor([-2.0, 0.0, 1.5, 3.0, -0.5])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0])
    calibration, from_probs, ctr = Calibration(), Calibration(from_logits=False), CTR()
    calibration.update(logits[:2], labels[:2])
    calibration.update(logits[2:], labels[2:])
    from_probs.update(torch.sigmoid(logits), labels)
    ctr.update(labels[:3])
    ctr.update(labels[3:])
    expected = sum(1 / (1 + math.exp(-x)) for x in logits.tolist()) / 2
    assert calibration.compute().item() == pytest.approx(expected, rel=1e-6)
    assert from_probs.compute().item() == pytest.approx(expected, rel=1e-6)
    assert ctr.compute().item() == pytest.approx(0.4)
    perfect = Calibration(from_logits=False)
    perfect.update(torch.full((4,), 0.25), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert perfect.compute().item() == pytest.approx(1.0), "as many clicks predicted as seen"
    no_positive = Calibration()
    no_positive.update(torch.zeros(3), torch.zeros(3))
    assert math.isnan(no_positive.compute().item()) and math.isnan(CTR().compute().item())
    with pytest.raises(ValueError, match="one shape"):
        Calibration().update(torch.zeros(3), torch.zeros(2))


