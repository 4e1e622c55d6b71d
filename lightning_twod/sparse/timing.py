"""Optional wall-clock timing of the phases of a sharded lookup, for benchmarks and profiling.

Off by default: a sharded collection times nothing unless its ``timer`` attribute is set, and then
costs two clock reads per phase and a few autograd hooks per step. Forward phases are timed as they
run; backward phases through hooks on the autograd nodes of one forward (``time_backward``):

=======================  =================================================================
``input_check``          ids/lengths/keys validation (and, with several shard groups, launching its flag)
``input_dist``           routing the ids and their all-to-alls (header, lengths + ids); with the input
                         pipeline, what the forward still waits for (the prefetch, one flag all-reduce)
``input_dist_ahead``     the input pipeline's worker thread on the next batch (hidden: not part of the step)
``lookup``               the owner's kernel forward (and the data-parallel tables' kernel)
``output_dist``          launching the pooled all-to-all, and at the first read of the result what is
                         left to wait for and the assembly of each feature's ``[B, D]``
``output_dist_backward`` launching the reverse all-to-all of the gradients, and at the end of the
                         backward what is left to wait for (the rest of the backward ran meanwhile)
``lookup_backward``      the kernel's backward; with FBGEMM this includes the fused row update
=======================  =================================================================

On an asynchronous device pass ``sync=torch.cuda.synchronize`` so that each phase is charged with
the device work it launched (this serializes the step: use it to locate costs, not for throughput).
Only torch and the standard library are imported here.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor


class PhaseTimer:
    """Seconds and call counts per phase name, summed until :meth:`reset`."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._open: dict[str, float] = {}
        self._active: dict[str, int] = {}

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    def start(self, name: str) -> None:
        self._open[name] = self.now()

    def stop(self, name: str) -> None:
        self.add(name, self.now() - self._open.pop(name))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(name, self.now() - start)

    def time_backward(self, output: Tensor, name: str, max_nodes: int = 256) -> None:
        """Charge to ``name`` the backward of the autograd subgraph that produced ``output``.

        The clock starts when the backward reaches ``output``'s node and stops after the last node
        of the subgraph below it (down to, not including, the leaves' gradient accumulation; at
        most ``max_nodes`` nodes) has run. Meant for a subgraph that only leads to
        its own leaves (a kernel's weights, one all-to-all), so that its nodes run back to back.
        """
        root = output.grad_fn
        if root is None:
            return
        nodes, seen, todo = [], {root}, [root]
        while todo and len(nodes) < max_nodes:
            node = todo.pop()
            nodes.append(node)
            for child, _ in node.next_functions:
                # AccumulateGrad nodes outlive the step (one per leaf): a hook there would fire in
                # every later backward too. The subgraph's own nodes are new in every forward.
                if child is not None and child not in seen and type(child).__name__ != "AccumulateGrad":
                    seen.add(child)
                    todo.append(child)
        mark: list[float] = []

        def begin(grad_outputs):
            mark[:] = [self.now()]

        def end(grad_inputs, grad_outputs):
            if mark:  # time since the previous mark: the total is first start -> last end
                now = self.now()
                self.seconds[name] += now - mark[0]
                mark[0] = now

        root.register_prehook(begin)
        for node in nodes:
            node.register_hook(end)
        self.calls[name] += 1

    def span_begin(self, name: str) -> None:
        """Open one of possibly overlapping intervals of ``name`` (e.g. DDP buckets in flight)."""
        if not self._active.get(name):
            self._open[name] = self.now()
        self._active[name] = self._active.get(name, 0) + 1

    def span_end(self, name: str) -> None:
        """Close one interval; the time from the first open to the last close counts once."""
        self._active[name] -= 1
        if not self._active[name]:
            self.stop(name)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def summary(self, steps: int = 1) -> dict[str, float]:
        """Milliseconds per step of each phase (``steps``: how many steps the sums cover)."""
        return {name: 1e3 * total / max(1, steps) for name, total in sorted(self.seconds.items())}
