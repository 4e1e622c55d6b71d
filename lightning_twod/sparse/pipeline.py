"""Input-dist pipelining: the ids of batch ``i + 1`` go to their owners while batch ``i`` trains.

The ids do not depend on any weight, so sending them one step early cannot change the math (the
pipelined run is bit-identical to the unpipelined one). For every sharded collection, a worker
thread runs the collection's whole input dist (check, routing, header and id all-to-alls) on the
features of the next batch, over a duplicate of the mesh's process groups (``groups``), so its
collectives never interleave with those of the step running meanwhile. One step, seen from a
collection::

    step i:   begin_step(batch i)      arm: collection.prefetched = ids sent ahead for batch i
              forward                  the lookup takes the armed ids if the batch is the one prefetched
              end_step(batch i + 1)    disarm; the worker starts sending batch i + 1's ids
              backward, optimizer      ... while they travel

Which features of a batch feed which collection is learned at the first training step: the forward
of a collection that receives one of the batch's own ``SparseFeatures`` (or ``KeyedJaggedTensor``)
objects records its place among them (``sparse_leaves``), and the places every rank found alike are
kept. A collection takes its armed ids only if every rank's features hold what was sent, compared by
content with a copy of the features taken when they were sent (``snapshot``), so that a batch that
``on_after_batch_transfer`` or ``training_step`` edited in place is seen as changed
(``ShardedCollection._take_prefetched``: one all-reduce of a flag); else every rank sends its ids
again, and that collection is no longer pipelined (its batch is transformed before the lookup).
Bad input still raises the same ``ValueError`` on every rank, in the forward of the bad batch.
Only torch and the standard library are imported here: the caller says what the next batch is.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.kjt import as_features, is_kjt
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.distributed.groups import MeshGroups, group_size
from lightning_twod.sparse.input_dist import DistributedIds

UNREADABLE = "the input pipeline could not read this rank's features of the batch"


def sparse_leaves(batch: Any, depth: int = 8) -> list[Any]:
    """The ``SparseFeatures`` and ``KeyedJaggedTensor`` objects of ``batch``, depth first, through
    mappings (in their order), lists, tuples and dataclass fields, at most ``depth`` levels down."""
    found: list[Any] = []

    def walk(obj: Any, level: int) -> None:
        if isinstance(obj, SparseFeatures) or is_kjt(obj):
            found.append(obj)
        elif level < depth:
            if isinstance(obj, Mapping):
                children = obj.values()
            elif isinstance(obj, (list, tuple)):
                children = obj
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
            else:
                return
            for child in children:
                walk(child, level + 1)

    walk(batch, 0)
    return found


def snapshot(features: SparseFeatures, device: torch.device) -> SparseFeatures:
    """``features`` as they are now, in tensors that no one else holds, once moved to ``device``.

    Where they are on ``device`` already, ``SparseFeatures.to`` hands back the batch's own tensors,
    which the user may still edit in place: then they are copied here. Elsewhere they are returned
    as they are, and the worker's ``to(device)`` makes the copy (an edit made while it copies is
    still found: the forward's features are compared with what was copied, and sent).

    Why a copy compared by content (``same_batch``), not the tensors' ``_version`` counters: the
    counters are O(1) but miss writes through ``.data``, a NumPy view or shared memory, and a copy
    sent to the device is a new tensor either way. The copy and the comparison each pass once over
    the ``[N]`` ids and weights and the ``[F * B]`` lengths, as each step of the input dist does.
    """
    here = features.device
    if here.type != device.type or (device.index is not None and here.index != device.index):
        return features
    weights = None if features.weights is None else features.weights.clone()
    return SparseFeatures(features.keys, features.values.clone(), features.lengths.clone(), weights,
                          batch_size=features.batch_size)


def same_batch(a: SparseFeatures, b: SparseFeatures) -> bool:
    """Whether ``a`` and ``b`` hold the same keys, lengths, ids and weights (on the same device), by
    content: one object or shared tensors may have been edited in place since ``a`` was sent."""
    if a.keys != b.keys or a.batch_size != b.batch_size or a.device != b.device:
        return False
    if (a.weights is None) != (b.weights is None):
        return False
    return (torch.equal(a.lengths, b.lengths) and torch.equal(a.values, b.values)
            and (a.weights is None or torch.equal(a.weights, b.weights)))


@dataclasses.dataclass
class Prefetched:
    """One collection's input dist of one batch, run by the worker thread.

    ``future`` resolves to ``(features, ids, seconds)``: the features it sent (on the lookup's
    device; ``batch_size`` 0 when unreadable), their ``DistributedIds`` and its wall time in the
    worker. ``counter``: the bytes it sent (added to the collection's counter when settled);
    ``outcome``: ``"used"`` or ``"missed"`` once a lookup decided (None: not looked at).
    """

    future: Future
    counter: ByteCounter | None
    outcome: str | None = None

    def take(self, features: SparseFeatures) -> tuple[bool, DistributedIds]:
        """Wait for it; whether ``features`` are the batch it sent, and its ids."""
        sent, ids, _ = self.future.result()
        return same_batch(sent, features), ids


class _Worker:
    """One daemon thread running jobs in submission order (the same order on every rank).

    A daemon, so that a rank whose peers died does not hang at exit in a collective of its own.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="twod-input-pipeline", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 (raised where the result is taken)
                future.set_exception(err)

    def close(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


class InputPipeline:
    """Sends the ids of the next training batch to their owners while the current batch trains.

    ``modules``: the sharded collections by path; ``groups``: a duplicate of their meshes' groups
    (``MeshGroups.duplicate``) by shard group size, used by the worker thread only (a collection whose
    tables have their own group sizes sends each part's ids over the part's); ``device``: the lookup's device.
    ``used`` and ``missed`` count the lookups that took prefetched ids and those that sent again.
    """

    def __init__(self, modules: Mapping[str, Any], groups: Mapping[int, MeshGroups], device: torch.device | str) -> None:
        self.modules = dict(modules)
        self.groups = dict(groups)
        self.world = next(iter(self.groups.values())).world
        self.device = torch.device(device)
        self.places: dict[str, int] | None = None  # path -> index among sparse_leaves(batch); None: not learned
        self.used = 0
        self.missed = 0
        # (position, [(path, part, its prefetch)]): one prefetch per part of a collection
        self._ahead: tuple[object, list[tuple[str, Any, Prefetched]]] | None = None
        self._armed: list[tuple[str, Any, Prefetched]] = []
        self._unsettled: list[tuple[str, Any, Prefetched]] = []
        self._seen: dict[str, int] = {}
        self._hooks: list[Any] = []
        self._worker = _Worker()

    # ------------------------------------------------------------------ one training step
    def begin_step(self, batch: Any, position: object) -> None:
        """Before the training step of ``batch``: arm the ids sent ahead for it.

        ``position`` names the batch's place in the loader's iteration (equal to the ``position``
        given with it to ``end_step`` when it was the next batch); prefetches for another place
        (a new epoch, a skipped batch) are dropped.
        """
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == position:
            self._armed = ahead[1]
            for _, part, prefetched in self._armed:
                part.prefetched = prefetched
        if self.places is None:
            self._learn(sparse_leaves(batch))

    def end_step(self, next_batch: Any | None, position: object) -> None:
        """After the training step's forward: disarm, and start sending ``next_batch``'s ids (None:
        there is none, e.g. the last batch of an epoch). ``position``: its place (see ``begin_step``).

        Every rank must call it at the same steps (after the first one, every rank agrees on where
        the features are: a collective).
        """
        for path, part, prefetched in self._armed:
            part.prefetched = None
            self.used += prefetched.outcome == "used"
            if prefetched.outcome == "missed" and path in self.places:  # decided on every rank alike
                self.missed += 1
                del self.places[path]
                warnings.warn(f"input pipelining stops for {path or 'the sparse module'}: its features in the "
                              "forward are not the batch's (transformed before the lookup?); its ids are sent "
                              "in the forward from now on", stacklevel=2)
        self._armed = []
        if self._hooks:
            self._agree_places()
        self._settle()
        if next_batch is None or not self.places:
            return
        leaves = sparse_leaves(next_batch)
        prefetches = []
        for path, index in self.places.items():
            twin = self.modules[path]
            taken = self._snapshot(twin, leaves[index] if index < len(leaves) else None)
            first = None
            for part in twin.parts():
                prefetched = self._launch(part, taken, first)
                first = first or prefetched
                prefetches.append((path, part, prefetched))
                self._unsettled.append((path, part, prefetched))
        self._ahead = (position, prefetches)

    def close(self, timeout: float = 60.0) -> None:
        """Wait for the jobs in flight, add their bytes and times, and stop the worker."""
        for _, part, _ in self._armed:
            part.prefetched = None
        self._armed, self._ahead = [], None
        self._remove_hooks()
        self._worker.close(timeout)
        self._settle(unfinished=True)

    # ------------------------------------------------------------------ internals
    def _snapshot(self, module: Any, leaf: Any | None) -> SparseFeatures | None:
        """The batch's features as they are now (None: unreadable), before the next step's hooks
        can edit them in place."""
        try:
            return snapshot(as_features(leaf, type(module).__name__), self.device)
        except Exception:  # noqa: BLE001 (the forward meets the same problem in the user's batch)
            return None

    def _launch(self, module: Any, taken: SparseFeatures | None, twin: Prefetched | None) -> Prefetched:
        """Send one part's ids of ``taken`` in the worker; a sibling part (``twin``: the twin's
        prefetch, run before it) sends nothing where the twin's check rejected the batch, on every
        rank alike (the twin's verdict is the world's)."""
        counter = None if module.counter is None else ByteCounter(module.counter.rank, module.counter.world_size)
        device, groups = self.device, self.groups[module.groups.dims.shard_group_size]

        def job():
            start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a thread starts on device 0
            error = None
            try:
                if taken is None:
                    raise ValueError(UNREADABLE)
                features = taken.to(device)
            except Exception:  # noqa: BLE001 (the forward meets the same problem in the user's batch)
                empty = torch.zeros(0, dtype=torch.int64, device=device)
                features, error = SparseFeatures([], empty, empty, batch_size=0), UNREADABLE
            if twin is not None and error is None:
                rejected = twin.future.result()[1]
                error = (rejected.error or "rejected by the collection's check") if rejected.rejected else None
            ids = module.input_dist(features, groups, counter, error=error)
            return features, ids, time.perf_counter() - start

        return Prefetched(self._worker.submit(job), counter)

    def _settle(self, unfinished: bool = False) -> None:
        """Add the bytes and worker seconds of finished prefetches (and, with ``unfinished``, at close,
        the bytes of the others) to their collection's counter and timer; a step's lookups' by the
        end of its forward."""
        keep = []
        for path, module, prefetched in self._unsettled:
            if not (unfinished or prefetched.future.done()):
                keep.append((path, module, prefetched))
                continue
            future = prefetched.future
            if module.counter is not None and prefetched.counter is not None:
                module.counter.merge(prefetched.counter)
            if module.timer is not None and future.done() and future.exception() is None:
                module.timer.add("input_dist_ahead", future.result()[2])
        self._unsettled = keep

    def _learn(self, leaves: list[Any]) -> None:
        """Record, during this step, which of ``leaves`` each collection's training forward receives."""
        def observe(path):
            def hook(module, args):
                if module.training and args and path not in self._seen:
                    index = next((i for i, leaf in enumerate(leaves) if leaf is args[0]), None)
                    if index is not None:
                        self._seen[path] = index
            return hook

        self._seen = {}
        self._hooks = [m.register_forward_pre_hook(observe(p)) for p, m in self.modules.items()]

    def _agree_places(self) -> None:
        """Keep the places that every rank found alike (a collective over the world)."""
        self._remove_hooks()
        world = self.world
        views = [self._seen]
        if group_size(world) > 1:
            views = [None] * dist.get_world_size(world)
            dist.all_gather_object(views, self._seen, group=world)
        self.places = {p: i for p, i in self._seen.items() if all(v.get(p) == i for v in views)}

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
