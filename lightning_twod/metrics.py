"""Click-through metrics that stay exact when validation is split over ranks.

* :class:`NormalizedEntropy` (NE): the mean log loss of the predictions divided by the entropy of
  the base rate (the fraction of positives) of the same samples. ``NE = 1`` is what always
  predicting the base rate achieves; lower is better. Its states are sums (log loss, positives,
  samples), reduced with a sum over the ranks, so the synced value equals the value on the
  concatenated data exactly (up to float64 rounding).
* :class:`AUC`: the exact area under the ROC curve (ties count one half): every rank keeps its
  scores and labels, and ``compute()`` gathers all of them (uneven sizes are fine).
* :class:`Calibration`: the sum of the predicted probabilities divided by the number of positives
  (1.0: as many clicks predicted as observed; above 1: over-prediction).
* :class:`CTR`: the click-through rate, the mean label.

Calibration and CTR keep sums (float64) reduced with a sum, exact over ranks as NE is. All are
``torchmetrics.Metric`` objects: update them in a step, call ``compute()`` (which syncs over
the default process group) at the end of the epoch, or pass them to ``self.log``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

__all__ = ["AUC", "CTR", "Calibration", "NormalizedEntropy", "binary_auc"]


def _check_shapes(preds: Tensor, target: Tensor) -> None:
    if preds.shape != target.shape:
        raise ValueError(f"preds {tuple(preds.shape)} and target {tuple(target.shape)} must have one shape")


class NormalizedEntropy(Metric):
    """``NE = (sum of log losses / N) / H(p)``, ``p = positives / N``, ``H(p) = -p log p - (1-p) log(1-p)``.

    Args:
        from_logits: ``preds`` are logits (default) or probabilities in ``[0, 1]``.
        eps: probabilities are clamped to ``[eps, 1 - eps]`` before the log (``from_logits=False``).

    ``compute()`` returns ``nan`` when the samples are all positive or all negative (``H(p) = 0``).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, from_logits: bool = True, eps: float = 1e-7, **kwargs) -> None:
        super().__init__(**kwargs)
        self.from_logits, self.eps = from_logits, eps
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("log_loss", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("positives", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("total", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """``preds`` (logits or probabilities) and ``target`` (0/1) of the same shape."""
        _check_shapes(preds, target)
        preds, target = preds.detach().double().flatten(), target.detach().double().flatten()
        if self.from_logits:
            loss = F.binary_cross_entropy_with_logits(preds, target, reduction="sum")
        else:
            p = preds.clamp(self.eps, 1 - self.eps)
            loss = -(target * p.log() + (1 - target) * (1 - p).log()).sum()
        self.log_loss += loss
        self.positives += target.sum()
        self.total += target.numel()

    def compute(self) -> Tensor:
        p = self.positives / self.total
        entropy = -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))
        if not bool(entropy > 0):
            return torch.tensor(float("nan"), dtype=torch.float32)
        return (self.log_loss / self.total / entropy).float()


class Calibration(Metric):
    """``sum of predicted probabilities / sum of labels`` over the samples seen (TorchRec's definition).

    Args:
        from_logits: ``preds`` are logits (default; squashed by a sigmoid) or probabilities.

    ``compute()`` returns ``nan`` when no sample is positive.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.from_logits = from_logits
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("predicted", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("positives", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """``preds`` (logits or probabilities) and ``target`` (0/1) of the same shape."""
        _check_shapes(preds, target)
        preds = preds.detach().double()
        self.predicted += (torch.sigmoid(preds) if self.from_logits else preds).sum()
        self.positives += target.detach().double().sum()

    def compute(self) -> Tensor:
        if not bool(self.positives > 0):
            return torch.tensor(float("nan"), dtype=torch.float32)
        return (self.predicted / self.positives).float()


class CTR(Metric):
    """The click-through rate ``sum of labels / number of samples``; ``nan`` before any sample."""

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("positives", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("total", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, target: Tensor) -> None:
        """``target``: 0/1 labels of any shape."""
        self.positives += target.detach().double().sum()
        self.total += target.numel()

    def compute(self) -> Tensor:
        if not bool(self.total > 0):
            return torch.tensor(float("nan"), dtype=torch.float32)
        return (self.positives / self.total).float()


def binary_auc(preds: Tensor, target: Tensor) -> Tensor:
    """Exact AUC of scores ``preds`` for 0/1 ``target`` (1-D): the probability that a random positive
    scores above a random negative, ties counting one half (Mann-Whitney U with average ranks).
    ``nan`` when ``target`` has no positives or no negatives."""
    preds, target = preds.flatten().double(), target.flatten().bool()
    positives = int(target.sum())
    negatives = target.numel() - positives
    if positives == 0 or negatives == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    _, inverse, counts = torch.unique(preds, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based rank of each distinct score, ties averaged
    rank_sum = average_rank[inverse][target].sum()
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


class AUC(Metric):
    """Exact area under the ROC curve (:func:`binary_auc`). ``preds`` may be logits, probabilities or
    any scores: AUC depends only on their order, and they are used as given (never squashed by a
    sigmoid, which would tie large scores). Every rank keeps its own samples (float64); ``compute()``
    gathers all of them, uneven sizes included."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("preds", default=[], dist_reduce_fx="cat")
        self.add_state("target", default=[], dist_reduce_fx="cat")

    def update(self, preds: Tensor, target: Tensor) -> None:
        _check_shapes(preds, target)
        self.preds.append(preds.detach().flatten().double())
        self.target.append(target.detach().flatten().to(torch.int8))

    def compute(self) -> Tensor:
        if isinstance(self.preds, list) and not self.preds:  # no update (after a sync: tensors)
            return torch.tensor(float("nan"))
        preds, target = dim_zero_cat(self.preds), dim_zero_cat(self.target)
        return binary_auc(preds, target).float()
