"""Measure the links and compute of the cluster this job runs on (``planner.links.LinkModel``).

``measure`` is a collective of every rank that runs the probe ``PROBE_REPEATS`` times in a row,
each bounded in time (``PROBE_BUDGET_S``), and returns the field-wise fastest of the repeats with
the repeats attached (``LinkModel.samples``): what else a host runs only adds time to a transfer,
so the fastest is the closest to what the links can do; the layout choice judges every candidate
on it, and predicts it on each repeat too (docs/planner.md). One probe times, with
every rank taking part at once (so shared links and shared CPU cores count as they will in
training):

* all-to-all and all-reduce inside a node (groups of the ranks of one node) and across nodes
  (groups of one rank per node): a small message for the latency, then messages grown until one
  takes ``BANDWIDTH_TARGET_S`` (or the size cap, or the budget, is reached) for the bandwidth;
  each size's fastest call counts. The bandwidth is the lower of two readings of the last two
  sizes: the last size's bytes over its time less the latency, and the bytes the last size adds
  over the time it adds. The second cancels what a transfer is given at once whatever its size:
  a link shaped by a token bucket (a cloud NIC's burst allowance, ``tc tbf``) moves its first
  bucketful at memory speed, so a message that fits in it, or is mostly it, reads as a faster
  link than training's long transfers get;
* a rank's compute: an embedding-bag lookup of random rows of a table larger than the caches,
  a streaming add, and the forward and backward of a two-layer MLP, on the rank's device;
* the share of an all-reduce's time that compute beside it still pays (``overlap_share``),
  measured once after the probes: the MLP alone, and beside an all-reduce of half its time
  (launched asynchronously first), in pairs; share = the pairs' median of (MLP beside it - MLP
  alone) / the all-reduce's time at the probes' fastest bandwidth and latency, the time the
  planner charges a share of. The all-reduce takes at least ``OVERLAP_MIN_TRANSFER_S``: a
  shorter one passes whole in a shaper's burst or a scheduler slice, so its own time reads short
  and any disturbance of the compute reads as a large share (a 5 ms all-reduce on the testbed
  read 1.5-7, one of 80 ms 0.3-0.7, where training's rounds paid at most 0.55). It is near 0
  where the collective has engines of its own (NCCL: copy engines, NIC) and near 1, or above,
  where it runs on the cores that compute (gloo on a CPU, its threads beside the training's).

Collective times are the slowest rank's (one max-reduce per size, so every rank takes the same
decisions); the result is rank 0's numbers, broadcast to all ranks, so every rank plans the same.
Probe collectives run on process groups of their own with a timeout: a probe that fails or
hangs on some rank (a link down) raises on every rank (``consensus.raise_on_every_rank``), in
at most ``COLLECTIVE_TIMEOUT_S``.

``measure_here`` runs it on local processes for ``lightning-twod plan``; ``lightning-twod calibrate``
(``cli.calibrate``) runs it on the cluster it is started on and writes the numbers as YAML.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lightning_twod.distributed.consensus import raise_on_every_rank
from lightning_twod.planner.links import CollectiveCost, LinkModel, fastest_of

#: What one probe may take (s), less what its messages need to read the bandwidth (``MIN_BANDWIDTH_S``);
#: ``measure`` runs ``PROBE_REPEATS`` of them (3-6 s at set-up).
PROBE_BUDGET_S = 1.0
#: Probes ``measure`` runs in a row: the fastest of three is steady where one probe is not (a
#: scheduler slice or a burst of other traffic slows one probe's numbers, rarely all three).
PROBE_REPEATS = 3
#: A bandwidth message grows until one call takes this long (s): long enough that the
#: latency is a small part of it, short enough to fit the budget.
BANDWIDTH_TARGET_S = 0.02
#: Seconds a probe collective may wait before the probe fails on that rank.
COLLECTIVE_TIMEOUT_S = 30.0
#: Bytes per rank of the latency message, and the first and largest bandwidth messages.
SMALL_BYTES = 256
FIRST_BYTES = 32 * 2**10
MAX_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}
#: Factor by which a bandwidth message grows until it takes ``BANDWIDTH_TARGET_S``.
GROWTH = 4
#: The budget stops the growth only once a call takes this many times the latency message's and at
#: least ``MIN_BANDWIDTH_S``: below that the bandwidth would be the latency's noise (a probe whose
#: compute part ran long, as on ranks that share cores, would otherwise report a fraction of the
#: real bandwidth) or a token bucket's burst (10 ms of traffic on the testbed's shaper, more on
#: some cloud NICs) would pass the whole message at once.
MIN_LATENCY_MULTIPLE = 4
MIN_BANDWIDTH_S = 0.01
#: Calls timed in a row per bandwidth message, and per latency message; one untimed call first.
REPEATS = 3
LATENCY_CALLS = 10
#: Compute probe sizes: table rows x dim (fp32; 64 MiB on CPU, 1 GiB on CUDA, beyond the caches),
#: looked-up ids, ids per bag; elements of the streaming add; MLP batch and width (about 10-30 ms a
#: call on one CPU core).
LOOKUP_ROWS = {"cpu": 2**18, "cuda": 2**22}
LOOKUP_DIM = 64
LOOKUP_IDS = {"cpu": 2**18, "cuda": 2**21}
BAG = 8
COPY_ELEMENTS = {"cpu": 2**23, "cuda": 2**26}
MLP_SHAPE = {"cpu": (2048, 256), "cuda": (16384, 2048)}
#: Timed calls of each compute probe (the fastest is kept): a few scheduler slices each on a CPU
#: shared by more ranks than cores.
COMPUTE_REPEATS = 5
#: Share of each probe's budget the overlap measurement takes (the collectives have the rest), and
#: its repeats, each the MLP alone and then beside the all-reduce (about twice the MLP's time). The
#: median of the pairs' differences counts, not the fastest of each: on ranks that share cores an
#: MLP now and then runs alone on a core (the others started late), which reads fast alone and
#: would make the difference of the fastest of each large.
OVERLAP_BUDGET_SHARE = 0.2
OVERLAP_REPEATS = 5
#: The overlap's all-reduce takes at least this long at the measured bandwidth (s), the MLP twice
#: that: several times a shaper's burst (10 ms of traffic on the testbed) and a scheduler slice.
OVERLAP_MIN_TRANSFER_S = 0.04

_ORDER = (("all_to_all", False), ("all_to_all", True), ("all_reduce", False), ("all_reduce", True))


class ProbeError(RuntimeError):
    """A probe collective failed or did not finish in time on this rank."""


def _kind(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(work, what: str, timeout: float) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except Exception as err:  # noqa: BLE001 (gloo and NCCL raise RuntimeError subclasses of their own)
        raise ProbeError(f"the links probe's {what} failed on rank {dist.get_rank()} within {timeout:.0f} s "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); a link between the ranks "
                         "may be down. Pass links= a preset or a file of `python -m lightning_twod calibrate` "
                         "to plan without measuring") from None


class _Probe:
    """The state of one measurement: groups, device, the time left."""

    def __init__(self, ranks_per_node: int, device: torch.device, budget_s: float, timeout_s: float) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.rpn = ranks_per_node if ranks_per_node and self.world % ranks_per_node == 0 else self.world
        self.nodes = self.world // self.rpn
        self.device, self.timeout, self.budget = device, timeout_s, budget_s
        self.start, self.elapsed = time.perf_counter(), 0.0  # elapsed: the slowest rank's, agreed
        opts = {"timeout": timedelta(seconds=timeout_s)}
        self.everyone = dist.new_group(list(range(self.world)), **opts)
        node, local = divmod(self.rank, self.rpn)
        # Every rank creates every group, in the same order: the groups get fresh names (a
        # counter, not a hash of their ranks), so a second probe in the same job does not meet
        # the store keys of the first one's destroyed groups.
        self.groups: dict[bool, tuple[object, int]] = {}
        self.created: list = []
        if self.rpn > 1:
            nodes = [dist.new_group(list(range(n * self.rpn, (n + 1) * self.rpn)), **opts) for n in range(self.nodes)]
            self.groups[False], self.created = (nodes[node], self.rpn), self.created + nodes
        if self.nodes > 1:
            columns = [dist.new_group([n * self.rpn + c for n in range(self.nodes)], **opts) for c in range(self.rpn)]
            self.groups[True], self.created = (columns[local], self.nodes), self.created + columns

    def close(self) -> None:
        for group in self.created:
            if group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        dist.destroy_process_group(self.everyone)

    def slowest(self, seconds: list[float]) -> list[float]:
        """The element-wise max of ``seconds`` over all ranks (float64, on the probe's own group);
        also agrees on the time spent so far, so that every rank takes the same decisions."""
        tensor = torch.tensor([*seconds, time.perf_counter() - self.start], dtype=torch.float64, device=self.device)
        _wait(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.everyone, async_op=True),
              "max-reduce of the timings", self.timeout)
        *out, self.elapsed = tensor.tolist()
        return out

    def _calls(self, kind: str, group, size: int, nbytes: int, count: int) -> float:
        """Seconds of the fastest of ``count`` back-to-back ``kind`` calls over ``group`` of ``size``
        ranks with ``nbytes`` per rank, after one untimed call; every rank starts after a common
        barrier. The fastest, not the mean: on a host whose cores are shared, a call now and then
        waits a scheduler slice or more, which only adds time and would otherwise decide the bandwidth."""
        elements = max(size, nbytes // 4 // size * size)
        send = torch.ones(elements, dtype=torch.float32, device=self.device)
        recv = torch.empty_like(send)

        def call():
            if kind == "all_to_all":
                return dist.all_to_all_single(recv, send, group=group, async_op=True)
            return dist.all_reduce(send, group=group, async_op=True)

        _wait(call(), kind, self.timeout)
        _wait(dist.barrier(group=self.everyone, async_op=True), "barrier", self.timeout)
        _sync(self.device)
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            _wait(call(), kind, self.timeout)
            _sync(self.device)
            seconds.append(time.perf_counter() - start)
        return min(seconds)

    def timed(self, kind: str, across: bool, nbytes: int, count: int = REPEATS) -> float:
        """Seconds per call, the slowest rank's fastest, of ``count`` calls in a row; every rank takes
        part in its own group of this class at once (a layout runs a collective in all its groups together)."""
        group, size = self.groups[across]
        return self.slowest([self._calls(kind, group, size, nbytes, count)])[0]

    def collective(self, kind: str, across: bool, share: float) -> CollectiveCost | None:
        """Bandwidth and latency of ``kind`` inside a node (``across=False``) or across nodes; None
        where that link does not exist here. ``share``: the fraction of the budget left to it.

        Latency: a call with a tiny message (``LATENCY_CALLS`` in a row). Bandwidth: the lower of the
        largest message's bytes over its time less that latency, and the bytes it adds to the size
        before it over the time it adds (module docstring).
        """
        size = self.nodes if across else self.rpn
        if size < 2:
            return None
        stop = self.elapsed + share * max(0.0, self.budget - self.elapsed)

        def sent(nbytes: int) -> float:  # bytes a rank sends for a message of nbytes per rank
            return (size - 1) / size * nbytes * (1 if kind == "all_to_all" else 2)

        small = self.timed(kind, across, SMALL_BYTES, LATENCY_CALLS)
        nbytes, cap = FIRST_BYTES, MAX_BYTES[_kind(self.device)]
        last = (SMALL_BYTES, small)
        took = self.timed(kind, across, nbytes)
        while took < BANDWIDTH_TARGET_S and nbytes < cap and (
                self.elapsed + 3 * (REPEATS + 1) * took < stop
                or took < max(MIN_LATENCY_MULTIPLE * small, MIN_BANDWIDTH_S)):
            last = (nbytes, took)
            nbytes = min(cap, nbytes * GROWTH)
            took = self.timed(kind, across, nbytes)
        bandwidth = read_bandwidth((sent(SMALL_BYTES), small), (sent(last[0]), last[1]), (sent(nbytes), took))
        if kind == "all_to_all":
            latency = small / (size - 1) if across else small
        else:
            latency = small / (2 * math.ceil(math.log2(size)))
        return CollectiveCost(bandwidth, latency)

    def overlap_share(self, cost: CollectiveCost, across: bool, seconds: float, dense_flops: float) -> float:
        """Share of an all-reduce's time that compute beside it still pays (module docstring), over
        the groups of ``across`` whose all-reduce ``cost`` describes; the MLP runs about
        ``seconds`` (at least twice ``OVERLAP_MIN_TRANSFER_S``) at this rank's ``dense_flops``."""
        group, size = self.groups[across]
        mlp, flops = _mlp_step(self.device)
        transfer_s = max(OVERLAP_MIN_TRANSFER_S, seconds / 2)  # it fits under the MLP alone
        calls = max(1, round(2 * transfer_s * dense_flops / flops))
        nbytes = min(cost.bandwidth * transfer_s * size / (2 * (size - 1)), MAX_BYTES[_kind(self.device)])
        elements = max(size, int(nbytes) // 4)
        buffer = torch.ones(elements, dtype=torch.float32, device=self.device)
        charged = (2 * math.ceil(math.log2(size)) * cost.latency
                   + 2 * (size - 1) / size * buffer.numel() * 4 / cost.bandwidth)

        def run(compute: bool, communicate: bool) -> float:
            _wait(dist.barrier(group=self.everyone, async_op=True), "barrier", self.timeout)
            _sync(self.device)
            start = time.perf_counter()
            work = dist.all_reduce(buffer, group=group, async_op=True) if communicate else None
            for _ in range(calls if compute else 0):
                mlp()
            if work is not None:
                _wait(work, "all_reduce", self.timeout)
            _sync(self.device)
            return time.perf_counter() - start

        run(True, True)  # untimed: first call of the pair
        pairs = [self.slowest([run(True, False), run(True, True)]) for _ in range(OVERLAP_REPEATS)]
        return share_of_pairs(pairs, charged)


def share_of_pairs(pairs: list[tuple[float, float]] | list[list[float]], charged: float) -> float:
    """The overlap share from ``(MLP alone, MLP beside the all-reduce)`` seconds of each repeat and
    the all-reduce's ``charged`` seconds: the median of the pairs' differences over ``charged``, at
    least 0 (``OVERLAP_REPEATS``' comment says why not the fastest of each)."""
    return max(0.0, statistics.median(both - alone for alone, both in pairs) / charged)


def read_bandwidth(small: tuple[float, float], before: tuple[float, float], last: tuple[float, float]) -> float:
    """Bytes per second of a link from ``(bytes sent, seconds)`` of the latency message, the size
    before the last and the last: the lower of the last size's bytes over its time less the
    latency's, and the bytes it adds to ``before`` over the time it adds, which cancels what the
    link passes at once whatever the size (a token bucket's burst; module docstring)."""
    bandwidth = (last[0] - small[0]) / max(last[1] - small[1], last[1] / 2)
    if last[1] > before[1] and last[0] > before[0]:
        bandwidth = min(bandwidth, (last[0] - before[0]) / (last[1] - before[1]))
    return bandwidth


def _fastest_time(fn, device: torch.device) -> float:
    """Seconds of the fastest of ``COMPUTE_REPEATS`` calls of ``fn``, after one untimed call."""
    fn()
    _sync(device)
    seconds = []
    for _ in range(COMPUTE_REPEATS):
        start = time.perf_counter()
        fn()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def _lookup_rate(device: torch.device) -> float:
    """Bytes per second an embedding-bag lookup of random rows reads on ``device``."""
    kind = _kind(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    table = torch.ones(LOOKUP_ROWS[kind], LOOKUP_DIM, device=device)
    ids = torch.randint(0, LOOKUP_ROWS[kind], (LOOKUP_IDS[kind],), generator=gen).to(device)
    offsets = torch.arange(0, LOOKUP_IDS[kind], BAG, device=device)
    seconds = _fastest_time(lambda: F.embedding_bag(ids, table, offsets, mode="sum"), device)
    return (ids.numel() + offsets.numel()) * LOOKUP_DIM * 4 / seconds


def _copy_rate(device: torch.device) -> float:
    """Bytes per second a streaming add moves on ``device`` (two reads and one write)."""
    a = torch.ones(COPY_ELEMENTS[_kind(device)], device=device)
    b, out = torch.ones_like(a), torch.empty_like(a)
    seconds = _fastest_time(lambda: torch.add(a, b, out=out), device)
    return 3 * a.numel() * 4 / seconds


def _mlp_step(device: torch.device):
    """(the forward and backward of a two-layer MLP on ``device``, its FLOPs by the 6 N rule)."""
    batch, width = MLP_SHAPE[_kind(device)]
    layers = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)).to(device)
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        layers(x).sum().backward()

    return step, 6 * sum(p.numel() for p in layers.parameters()) * batch  # the 6 N rule the model applies


def _dense_rate(device: torch.device) -> float:
    """FLOP/s of the forward and backward of a two-layer MLP on ``device`` (the 6 N rule)."""
    step, flops = _mlp_step(device)
    return flops / _fastest_time(step, device)


def measure_compute(device: torch.device) -> tuple[float, float, float]:
    """(lookup bytes/s, copy bytes/s, dense FLOP/s) of this rank's device (see the module docstring);
    each probe's tensors are freed before the next one is made."""
    return _lookup_rate(device), _copy_rate(device), _dense_rate(device)


def _local_measurement(ranks_per_node: int, device: torch.device, budget_s: float, timeout_s: float) -> list[float]:
    """One probe's numbers (``_from_values``' order), its overlap share still NaN."""
    probe = _Probe(ranks_per_node, device, budget_s * (1 - OVERLAP_BUDGET_SHARE), timeout_s)
    try:
        _wait(dist.barrier(group=probe.everyone, async_op=True), "barrier", timeout_s)
        compute = measure_compute(device)
        probe.slowest([])  # agree on the time spent so far
        costs: list[CollectiveCost | None] = []
        for index, (kind, across) in enumerate(_ORDER):
            costs.append(probe.collective(kind, across, 1.0 / (len(_ORDER) - index)))
    finally:
        probe.close()
    values = [float(probe.rpn), math.nan, *compute]
    for cost in costs:
        values += [math.nan, math.nan] if cost is None else [cost.bandwidth, cost.latency]
    return values


def _overlap_measurement(ranks_per_node: int, device: torch.device, probes: list[list[float]], budget_s: float,
                         timeout_s: float) -> float:
    """The overlap share (module docstring) over the reduction's replica groups (across nodes where
    there are several), timed against the fastest all-reduce of ``probes`` (``_local_measurement``'s
    rows, agreed on every rank); the MLP runs about ``budget_s`` over the repeats."""
    fastest = fastest_of([_from_values(row, "") for row in probes], "", "")
    probe = _Probe(ranks_per_node, device, budget_s, timeout_s)
    try:
        across = probe.nodes > 1
        cost = fastest.all_reduce_inter if across else fastest.all_reduce_intra
        seconds = budget_s / (2 * (OVERLAP_REPEATS + 1))
        return probe.overlap_share(cost, across, seconds, fastest.dense_flops)
    finally:
        probe.close()


def measure(ranks_per_node: int, device: torch.device, group=None, budget_s: float = PROBE_BUDGET_S,
            timeout_s: float = COLLECTIVE_TIMEOUT_S, repeats: int = PROBE_REPEATS) -> LinkModel:
    """Probe the links and compute of the job ``repeats`` times (a collective of every rank of the
    default group); ``budget_s``: the bound of one probe.

    Returns, on every rank, the fastest of rank 0's probes, field by field, with the probes as
    ``samples``; the overlap share is measured once, after the probes, and is every sample's. A
    link that does not exist here (one node: nothing across nodes; one rank per node: nothing
    inside) takes the other class's numbers, so that a plan for this job never depends on it. Raises the same error on every rank when a probe fails on any.
    """
    world = group or dist.group.WORLD
    if dist.get_world_size(world) < 2:
        raise ValueError("measuring links needs at least 2 ranks; one process has no links to plan for")
    with raise_on_every_rank(world):
        values = [_local_measurement(ranks_per_node, device, budget_s, timeout_s) for _ in range(repeats)]
        share = _overlap_measurement(ranks_per_node, device, values, repeats * budget_s * OVERLAP_BUDGET_SHARE,
                                     timeout_s)
    for row in values:
        row[1] = share
    tensor = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.broadcast(tensor, src=0, group=world)
    source = (f"measured on {dist.get_world_size()} ranks, the fastest of {repeats} probes "
              f"({time.strftime('%Y-%m-%d %H:%M:%S')})")
    return fastest_of([_from_values(row, source) for row in tensor.tolist()], "measured", source)


def _from_values(values: list[float], source: str) -> LinkModel:
    rpn, share, lookup, copy, dense, *pairs = values
    costs = [None if math.isnan(pairs[2 * i]) else CollectiveCost(pairs[2 * i], pairs[2 * i + 1])
             for i in range(len(_ORDER))]
    a2a_intra, a2a_inter, ar_intra, ar_inter = costs
    a2a_intra, a2a_inter = a2a_intra or a2a_inter, a2a_inter or a2a_intra
    ar_intra, ar_inter = ar_intra or ar_inter, ar_inter or ar_intra
    return LinkModel(a2a_intra, a2a_inter, ar_intra, ar_inter, lookup, copy, dense, int(rpn), overlap_share=share,
                     name="measured", source=source)


def _measure_rank(rank: int, nproc: int, init: str, device_type: str, ranks_per_node: int, budget_s: float,
                  timeout_s: float, results) -> None:
    """One local rank of ``measure_here``: rank 0 puts the numbers (a YAML container) on ``results``."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=timeout_s))
    try:
        links = measure(ranks_per_node, device, budget_s=budget_s, timeout_s=timeout_s)
        dist.barrier()  # every rank is done with the probe's groups before any leaves
        if rank == 0:
            results.put(links.to_container())
    finally:
        dist.destroy_process_group()


def measure_here(nproc: int, device_type: str, ranks_per_node: int, budget_s: float = PROBE_BUDGET_S,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> LinkModel:
    """``measure`` on ``nproc`` processes started here (one node; spawned): what a fit of
    ``nproc`` ranks per node measures at set-up, without the links across nodes."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_measure_rank, args=(nproc, f"file://{os.path.join(tmp, 'store')}", device_type,
                                                ranks_per_node, budget_s, timeout_s, results),
                           nprocs=nproc, join=True, start_method="spawn")
    return LinkModel.from_container(results.get(), where="links measured here")

