"""The batch that Lightning's training loop runs next, seen one step ahead (for input-dist pipelining).

Lightning's training data fetcher (``_PrefetchDataFetcher``) holds the next batch itself only for
loaders without a length; for sized loaders it reads each batch when the step asks for it. Then
``next_batch`` wraps the fetcher's iterator in a ``Lookahead`` that reads one item ahead (as the
fetcher would), so the next batch is known while the current one trains. The batch is as the
loader made it: before ``on_before_batch_transfer`` and the move to the device.

A loader that keeps its own state in checkpoints (``state_dict``/``load_state_dict``, e.g. torchdata's
``StatefulDataLoader``) is never read ahead: its saved state would count the batch read early, and a
resumed run would skip it. Its batches are then not pipelined (unless it has no length, where the
fetcher reads ahead itself).

A *position* names a batch's place in the iteration: ``(iterator, batches handed out)``; the next
batch's position, taken now, equals the current batch's position taken at its own step. A new
epoch makes a new iterator, so nothing carries over from one epoch to the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

_UNREAD, _END = object(), object()


class Lookahead(Iterator):
    """An iterator that can ``peek`` at its next item without consuming it."""

    def __init__(self, iterator: Iterator) -> None:
        self._iterator = iterator
        self._next: Any = _UNREAD

    def peek(self) -> Any:
        """The next item, or None at the end."""
        if self._next is _UNREAD:
            try:
                self._next = next(self._iterator)
            except StopIteration:
                self._next = _END
        return None if self._next is _END else self._next

    def __next__(self) -> Any:
        item, self._next = self._next, _UNREAD
        if item is _UNREAD:
            return next(self._iterator)
        if item is _END:
            raise StopIteration
        return item


def _fetcher(trainer) -> _PrefetchDataFetcher | None:
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    return fetcher if isinstance(fetcher, _PrefetchDataFetcher) and fetcher.iterator is not None else None


def position(trainer) -> tuple[Any, int] | None:
    """The place of the training batch being run now (None: the loop has no prefetching fetcher)."""
    fetcher = _fetcher(trainer)
    return None if fetcher is None else (fetcher.iterator, _handed_out(fetcher))


def _handed_out(fetcher: _PrefetchDataFetcher) -> int:
    return fetcher.fetched - len(fetcher.batches)  # read from the loader, less those it holds


def next_batch(trainer) -> tuple[Any, tuple[Any, int]] | None:
    """``(batch, position)`` of the training batch after the current one, or None: the epoch ends
    here (or the loop hands ``training_step`` a ``dataloader_iter``, and fetches nothing itself)."""
    fetcher = _fetcher(trainer)
    if fetcher is None or fetcher.done:
        return None
    if fetcher.batches:  # a loader without length: the fetcher holds the next batch already
        item = fetcher.batches[0]
    elif any(isinstance(loader, _Stateful) for loader in fetcher.combined_loader.flattened):
        return None
    else:
        if not isinstance(fetcher.iterator, Lookahead):
            fetcher.iterator = Lookahead(fetcher.iterator)
        item = fetcher.iterator.peek()
        if item is None:
            return None
    batch, _batch_idx, _dataloader_idx = item
    return batch, (fetcher.iterator, _handed_out(fetcher) + 1)
