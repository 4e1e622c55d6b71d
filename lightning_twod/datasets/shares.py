"""Which rows of a prepared split each rank and each DataLoader worker reads: arithmetic only, no I/O.

An epoch orders the split's row groups (shuffled with ``(seed, epoch)``, the same on every rank, or
in file order) and reads their rows as one sequence of ``N`` rows. Rank ``r`` of ``W`` takes one
contiguous range of it, so it reads about ``N / W`` rows (its row groups, plus at most the partial
ones at both ends):

* training (``drop_last``): ``G = N // (B W)`` global batches; rank ``r`` reads rows
  ``[r G B, (r + 1) G B)``, and the rest (fewer than ``B W`` rows, today's incomplete last global
  batch) is left out;
* evaluation: ``N`` split as evenly as possible (ranks below ``N % W`` take one row more); every rank
  runs ``ceil(ceil(N / W) / B)`` batches (``sharding.batches_per_rank``), and a rank whose rows end a
  batch early runs one more with a single padding sample (``index = -1``), as ``EvalShardSampler`` does.

Rank batch ``j`` is rows ``[j B, (j + 1) B)`` of the rank's range, whatever the number of workers.
With ``K`` workers, worker ``k`` builds a contiguous run of the rank's batches (the first
``nb % K`` runs one longer), so it reads about ``1 / K`` of the rank's row groups; the DataLoader
hands batches out round robin, so the rank's ``t``-th batch is worker ``t % K``'s ``(t // K)``-th.
A loader resumed after ``n`` batches gives DataLoader worker ``w`` the part of worker ``(w + n) % K``
less the batches of it already handed out, so the round robin goes on where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_twod.datasets.sharding import batches_per_rank


@dataclass(frozen=True)
class RankShare:
    """Rank's range of the epoch's rows: ``first`` (a row of the sequence), ``rows`` rows, ``batches`` batches."""

    first: int
    rows: int
    batches: int
    batch_size: int

    def batch_rows(self, j: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of the epoch's sequence in rank batch ``j`` (empty: a padding batch)."""
        lo, hi = min(j * self.batch_size, self.rows), min((j + 1) * self.batch_size, self.rows)
        return self.first + lo, self.first + hi


def rank_share(total: int, world_size: int, rank: int, batch_size: int, drop_last: bool) -> RankShare:
    """The range of rank ``rank`` of ``world_size`` over ``total`` rows (module doc)."""
    if drop_last:
        per_rank = total // (batch_size * world_size) * batch_size
        return RankShare(rank * per_rank, per_rank, per_rank // batch_size, batch_size)
    base, extra = divmod(total, world_size)
    rows = base + (rank < extra)
    return RankShare(rank * base + min(rank, extra), rows, batches_per_rank(total, world_size, batch_size), batch_size)


def worker_batches(batches: int, workers: int, worker: int, delivered: int = 0) -> range:
    """Rank batches that DataLoader worker ``worker`` of ``workers`` builds, in order, once the loader
    has handed out ``delivered`` batches of the epoch (module doc)."""
    part = (worker + delivered) % workers
    base, extra = divmod(batches, workers)
    start = part * base + min(part, extra)
    done = max(0, (delivered - part + workers - 1) // workers)  # handed-out t < delivered with t % K == part
    return range(start + done, start + base + (part < extra))


def delivery_order(batches: int, workers: int) -> list[int]:
    """Rank batches in the order a DataLoader with ``workers`` workers hands them out."""
    parts = [worker_batches(batches, workers, k) for k in range(workers)]
    return [part[i] for i in range(len(parts[0]) if parts else 0) for part in parts if i < len(part)]


def group_order(groups: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The epoch's order of ``groups`` row groups ``[groups]``: a permutation drawn from ``(seed, epoch)``
    (the same on every rank), or ``0 ... groups - 1``."""
    return np.random.default_rng([seed, epoch]).permutation(groups) if shuffle else np.arange(groups)
