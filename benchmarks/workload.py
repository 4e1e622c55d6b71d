"""The benchmark workload shared by every system of ``throughput.py`` and ``scaling.py`` (imports only torch).

One synthetic DLRM: ``num_tables`` tables of ``rows x dim`` (the first of ``big_rows`` rows where that is
set: a skewed model; one feature ``cat_i`` per table, one id per sample, power-law ids from
``lightning_twod.datasets.synthetic``), 13 dense inputs, bottom MLP
``13 -> 256 -> dim``, pairwise-dot interaction, top MLP ``-> 256 -> 128 -> 1``; BCE loss, the mean
over the local batch. Embedding rows are trained by row-wise AdaGrad (lr 0.01), dense parameters by
Adam (lr 1e-3), in every system. ``model="bare"`` is the embedding path alone: nothing before the
lookup, its pooled rows ``[B, tables * dim]`` straight into one linear layer (the dense inputs unused).

The batches are generated once by the orchestrator (project environment) and saved to one file,
so every system, TorchRec's included, trains on exactly the same ids::

    dense [steps, world, batch, 13] float32, ids [steps, world, tables, batch] int64,
    label [steps, world, batch] float32

``scaling.py`` also uses bags of several ids (``min_ids``/``max_ids``), saved per rank by
:func:`make_rank_batches`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

NUM_DENSE = 13


@dataclass
class Workload:
    num_tables: int = 8
    rows: int = 100_000
    dim: int = 64
    batch: int = 1024  # per rank
    world: int = 4
    steps: int = 30  # per run, warm-up included
    warmup: int = 10  # steps not timed
    bottom: list[int] = field(default_factory=lambda: [256])
    top: list[int] = field(default_factory=lambda: [256, 128])
    dense_lr: float = 1e-3
    sparse_lr: float = 0.01
    sparse_eps: float = 1e-8
    skew: float = 3.0
    seed: int = 0
    min_ids: int = 1  # ids per bag: uniform in [min_ids, max_ids] (1, 1: one id per sample and table)
    max_ids: int = 1
    big_rows: int = 0  # rows of the first table (0: ``rows`` like the others)
    model: str = "dlrm"  # "dlrm" (bottom MLP, interaction, top MLP) or "bare" (lookup -> one linear layer)
    memory_gb: float | None = None  # memory_per_rank_gb the strategy plans with (None: the device's)

    @property
    def table_rows(self) -> list[int]:
        return [self.big_rows or self.rows] + [self.rows] * (self.num_tables - 1)

    @property
    def keys(self) -> list[str]:
        return [f"cat_{i}" for i in range(self.num_tables)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        return cls(**json.loads(text))


def make_batches(work: Workload, path: str) -> None:
    """Generate the batches of every (step, rank) with the project's synthetic data and save them."""
    from lightning_twod.datasets.synthetic import SyntheticClicks

    data = SyntheticClicks(work.table_rows, work.steps * work.world * work.batch,
                           num_dense=NUM_DENSE, skew=work.skew, seed=work.seed)
    dense, ids, label = [], [], []
    for step in range(work.steps):
        for rank in range(work.world):
            start = (step * work.world + rank) * work.batch
            batch = data.collate(list(range(start, start + work.batch)))
            dense.append(batch["dense"])
            ids.append(batch["sparse"].values.view(work.num_tables, work.batch))
            label.append(batch["label"])
    shape = (work.steps, work.world)
    torch.save({"dense": torch.stack(dense).view(*shape, work.batch, NUM_DENSE),
                "ids": torch.stack(ids).view(*shape, work.num_tables, work.batch),
                "label": torch.stack(label).view(*shape, work.batch)}, path)


def make_rank_batches(work: Workload, folder: str) -> None:
    """Like :func:`make_batches`, with bags of ``min_ids..max_ids`` ids, one file per rank
    (``rank<r>.pt``: a rank reads only its own steps).

    Dense inputs and labels are the synthetic data's; with more than one id a bag, the ids are
    drawn from the same power law (``floor(rows * u ** skew)``) by a generator seeded by
    ``(seed, rank)``, and the bag sizes uniformly.
    """
    from lightning_twod.datasets.synthetic import SyntheticClicks

    os.makedirs(folder, exist_ok=True)
    data = SyntheticClicks(work.table_rows, work.steps * work.world * work.batch,
                           num_dense=NUM_DENSE, skew=work.skew, seed=work.seed)
    bags = work.num_tables * work.batch
    for rank in range(work.world):
        generator = torch.Generator().manual_seed(work.seed * 1000 + rank)
        steps = []
        for step in range(work.steps):
            start = (step * work.world + rank) * work.batch
            batch = data.collate(list(range(start, start + work.batch)))
            values, lengths = batch["sparse"].values, torch.ones(bags, dtype=torch.int64)
            if work.max_ids > 1:
                lengths = torch.randint(work.min_ids, work.max_ids + 1, (bags,), generator=generator)
                u = torch.rand(int(lengths.sum()), generator=generator, dtype=torch.float64)
                values = (u ** work.skew * work.rows).long().clamp(max=work.rows - 1)
            steps.append((batch["dense"], values, lengths, batch["label"]))
        torch.save(steps, os.path.join(folder, f"rank{rank}.pt"))


def load_rank_batches(folder: str, rank: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """``[(dense [B, 13], values [N], lengths [tables * B] (table-major), label [B])]`` of one rank."""
    return torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=True)


def load_batches(path: str, rank: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``[(dense [B, 13], ids [tables, B], label [B])]`` of one rank, one per step."""
    data = torch.load(path, weights_only=True)
    return [(data["dense"][s, rank], data["ids"][s, rank], data["label"][s, rank])
            for s in range(data["dense"].shape[0])]


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def interact(dense: Tensor, pooled: list[Tensor], top: nn.Module) -> Tensor:
    """DLRM's dot interaction (as ``lightning_twod.models.dlrm.DLRM.forward``): logits ``[B]``."""
    vectors = torch.stack([dense, *pooled], dim=1)
    dots = torch.bmm(vectors, vectors.transpose(1, 2))
    i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
    return top(torch.cat([dense, dots[:, i, j]], dim=1)).squeeze(1)


def bare_head(work: Workload) -> nn.Linear:
    """The bare model's head: the pooled rows of every table ``[B, tables * dim]`` -> a logit."""
    return nn.Linear(work.num_tables * work.dim, 1)


def top_input_size(work: Workload) -> int:
    vectors = work.num_tables + 1
    return work.dim + vectors * (vectors - 1) // 2


def load_phase_timer():
    """``lightning_twod.sparse.timing.PhaseTimer`` loaded from its file (pure torch), so that the
    TorchRec environment, which has no Lightning, uses the very same timer."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "lightning_twod", "sparse", "timing.py")
    spec = importlib.util.spec_from_file_location("_twod_timing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PhaseTimer


def timed_allreduce_hook(timer):
    """A DDP comm hook: the default bucket all-reduce, timed by ``timer`` two ways.

    ``dense_allreduce``: one span from the first bucket launched to the last bucket reduced; it
    encloses whatever backward work runs meanwhile (the lookups', the output all-to-all's).
    ``dense_wait``: what the step waits for it, the time from the end of the backward's own work
    (every autograd node run, so every bucket launched) to the last bucket reduced, zero when the
    buckets were reduced before. The end of the backward's work is read by a callback queued on the
    autograd engine at the first bucket of a backward, which runs before DDP's own (queued at the
    last bucket), the one that waits for the buckets. ``hook.marks``: per backward, the clock
    (``time.perf_counter``, one clock for every process of a host) at the end of its own work and
    at its last bucket reduced, for ``last_rank_wait``.
    """
    import threading

    from torch.autograd import Variable
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    lock = threading.Lock()
    state = {"in_flight": 0, "queued": False, "compute_end": None}

    def compute_done():
        with lock:
            state["queued"] = False
            if state["in_flight"]:
                state["compute_end"] = timer.now()
            else:
                timer.add("dense_wait", 0.0)
                hook.marks.append((timer.now(),) * 2)

    def hook(_, bucket):
        with lock:
            if not state["queued"]:
                state["queued"], state["compute_end"] = True, None
                Variable._execution_engine.queue_callback(compute_done)
            state["in_flight"] += 1
            timer.span_begin("dense_allreduce")

        def done(fut):
            with lock:
                now = timer.now()
                timer.span_end("dense_allreduce")  # read after ``now``: the wait ends inside the span
                state["in_flight"] -= 1
                if not state["in_flight"] and state["compute_end"] is not None:
                    timer.add("dense_wait", now - state["compute_end"])
                    hook.marks.append((state["compute_end"], now))
                    state["compute_end"] = None
            return fut.value()

        return allreduce_hook(None, bucket).then(done)

    hook.marks = []
    return hook


def last_rank_wait(marks_by_rank: list[list[list[float]]]) -> float | None:
    """Ms per step the rank whose backward ended last waited for DDP's all-reduce: the mean over
    steps of (that rank's last bucket reduced - the end of its backward's own work), from each
    rank's ``timed_allreduce_hook`` marks of the same steps (ranks of one host: one clock). What
    the other ranks wait beyond it is for that rank; None without marks."""
    steps = min((len(m) for m in marks_by_rank), default=0)
    if not steps:
        return None
    waits = []
    for i in range(steps):
        end, done = max((m[-steps + i] for m in marks_by_rank), key=lambda mark: mark[0])
        waits.append(done - end)
    return 1e3 * sum(waits) / steps


class StepClock:
    """Wall time of the timed steps (after ``warmup``) and per-step phase sums, written as JSON."""

    def __init__(self, work: Workload, timer) -> None:
        self.work, self.timer = work, timer
        self.start: float | None = None
        self.end: float | None = None
        self.step_times: list[float] = []
        self._step_start = 0.0
        self.cpu_start = self.cpu_end = 0.0

    def step_begin(self, step: int) -> None:
        now = time.perf_counter()
        if step == self.work.warmup:
            self.timer.reset()
            self.start = now
            self.cpu_start = time.process_time()
        self._step_start = now

    def step_end(self, step: int) -> None:
        now = time.perf_counter()
        if step >= self.work.warmup:
            self.step_times.append(now - self._step_start)
            self.end = now
            self.cpu_end = time.process_time()

    def report(self, system: str, rank: int, extra: dict | None = None) -> dict:
        timed = len(self.step_times)
        wall = (self.end - self.start) if timed else float("nan")
        return {"system": system, "rank": rank, "timed_steps": timed, "wall_s": wall,
                "step_ms": 1e3 * wall / max(1, timed),
                "cpu_ms": 1e3 * (self.cpu_end - self.cpu_start) / max(1, timed), "step_ms_each": [1e3 * t for t in self.step_times],
                "phases_ms": self.timer.summary(timed), **(extra or {})}


def write_report(out_dir: str, rank: int, report: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
