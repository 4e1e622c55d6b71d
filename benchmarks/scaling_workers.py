"""One rank of ``scaling.py``'s ``twod_sparse`` jobs, and what both of its workers share.

A job is one torchrun launch on the two-node testbed that runs many configurations ("cells") one
after another in the same processes, each with ``warmup`` untimed steps and then ``steps`` timed
ones. For each cell the ranks gather their reports, and rank 0 appends one JSON line (every rank's
report, the load average before and after) to the job's output file at once, so a cell that
finished is never lost.

    python -m torch.distributed.run ... benchmarks/scaling_workers.py --job JOB.json

``JOB.json``: ``{"workload": Workload fields, "batches": folder of rank<r>.pt, "cells": [cell],
"out": JSONL path, "meta": fields copied into every line}``. A twod cell:
``{"name", "system": "twod", "shard": S, "placement", "interval", "overlap", "dtype", "warmup",
"steps"}``, and optionally ``"pipeline": true`` (default false: the cells measured before it).

The helpers above ``run_twod_cell`` need only torch, so that the TorchRec worker (its own
environment, no Lightning) shares them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workload as W  # noqa: E402

PLAIN_REPEATS = 2  # plain all-reduces timed per cell, next to the rounds


# ----------------------------------------------------------------------------- shared by both workers
def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def init_world() -> None:
    """The default (gloo) group, with a timeout long enough for a 1 Gbit/s round of a large table."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(minutes=30))


def time_plain_all_reduce(nbytes: int, dtype: torch.dtype, group, repeats: int = PLAIN_REPEATS) -> list[float]:
    """Seconds of ``dist.all_reduce`` of a ``dtype`` buffer of ``nbytes`` over ``group``, every
    replica group at once (a world barrier before each, so all of them start together)."""
    element = torch.empty(0, dtype=dtype).element_size()
    buffer = torch.ones(max(1, nbytes // element), dtype=dtype)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        seconds.append(time.perf_counter() - start)
    return seconds


#: Probed values that are levels, not counts: what the rounds hold besides the tables (``ReplicaReducer.memory``).
GAUGES = ("round_memory_bytes", "round_memory_elements")


class Window:
    """The timed steps of one cell: per-step wall time, and counters read at its two ends.

    ``probe()`` returns a flat ``{name: number}`` of cumulative counters (seconds, bytes, rounds);
    the report holds each one's change over the window, except for names in ``GAUGES``, read at its
    end. Names ending in ``_s`` are seconds the training thread spent in the reduction
    (``ReplicaReducer.seconds``, or TorchRec's ``sync()``).
    """

    def __init__(self, warmup: int, steps: int, timer, probe) -> None:
        self.warmup, self.steps, self.timer, self.probe = warmup, steps, timer, probe
        self.step_s: list[float] = []
        self.first = self.last = None
        self.phases: dict[str, float] = {}
        self._start = self._wall0 = self._cpu0 = self._thread0 = 0.0
        self.wall = self.cpu = self.thread_cpu = 0.0

    def step_begin(self, step: int) -> None:
        now = time.perf_counter()
        if step == self.warmup:
            self.timer.reset()
            self.first, self._wall0, self._cpu0 = self.probe(), now, time.process_time()
            self._thread0 = time.thread_time()
        self._start = now

    def step_end(self, step: int) -> None:
        now = time.perf_counter()
        if self.warmup <= step < self.warmup + self.steps:
            self.step_s.append(now - self._start)
        if step == self.warmup + self.steps - 1:
            self.last, self.wall, self.cpu = self.probe(), now - self._wall0, time.process_time() - self._cpu0
            self.thread_cpu = time.thread_time() - self._thread0
            self.phases = self.timer.summary(self.steps)

    def report(self) -> dict:
        if self.last is None:
            raise RuntimeError(f"the fit ended before its {self.warmup + self.steps} steps")
        delta = {k: self.last[k] - (0 if k in GAUGES else self.first[k]) for k in self.last}
        return {"timed_steps": self.steps, "warmup": self.warmup, "wall_s": self.wall,
                "step_ms": 1e3 * self.wall / self.steps, "step_ms_each": [1e3 * s for s in self.step_s],
                "cpu_ms": 1e3 * self.cpu / self.steps, "thread_cpu_ms": 1e3 * self.thread_cpu / self.steps,
                "phases_ms": self.phases, "counters": delta}


def plain_for_round(report: dict, dtype: torch.dtype, group) -> None:
    """Adds to ``report`` the timed plain all-reduce of one round's payload bytes over ``group``."""
    rounds = report["counters"].get("rounds", 0)
    nbytes = int(report["counters"].get("payload_bytes", 0) // rounds) if rounds else 0
    here = torch.tensor([int(group is not None and dist.get_world_size(group) > 1 and nbytes > 0)])
    dist.all_reduce(here, op=dist.ReduceOp.MIN)  # the timing takes world barriers: all ranks or none
    if not here.item():
        return
    report["plain"] = {"bytes": nbytes, "dtype": str(dtype).replace("torch.", ""),
                       "ms": [1e3 * s for s in time_plain_all_reduce(nbytes, dtype, group)]}


def publish(cell: dict, meta: dict, out: str, report: dict, before: str, seconds: float) -> None:
    """Gather every rank's report of ``cell``; rank 0 appends one line to ``out`` (``seconds``: the
    cell's whole time, set-up and plain all-reduces included)."""
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        line = {**meta, "cell": cell, "ranks": reports, "loadavg_before": before, "loadavg_after": loadavg(),
                "seconds": seconds, "finished": time.time()}
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        step = max(r.get("step_ms", float("nan")) for r in reports)
        print(f"[scaling] {meta.get('workload')} {meta.get('rate')} round {meta.get('round')}: {cell['name']:<32} "
              f"{step:9.1f} ms/step  (load {before} -> {loadavg()})", flush=True)


def run_job(job_path: str, run_cell) -> None:
    """Runs every cell of the job with ``run_cell(cell, work, batches) -> report``, in order."""
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    init_world()
    work = W.Workload(**job["workload"])
    batches = W.load_rank_batches(job["batches"], dist.get_rank())
    for cell in job["cells"]:
        before, start = loadavg(), time.perf_counter()
        try:
            report = run_cell(cell, work, batches)
        except Exception:  # deterministic failures hit every rank alike: the next cells still run
            report = {"error": traceback.format_exc()[-3000:]}
        publish(cell, job["meta"], job["out"], report, before, time.perf_counter() - start)
        gc.collect()
    dist.barrier()


# ----------------------------------------------------------------------------- twod_sparse cells
def run_twod_cell(cell: dict, work: W.Workload, batches: list) -> dict:
    """One Lightning fit of ``TwoDSparseStrategy`` on this cell's layout, of the workload's model (the
    bundled ``DLRM``, or the bare embedding path); the rank's report."""
    import lightning.pytorch as pl
    from timed_steps import TimedSteps
    from torch.utils.data import DataLoader

    from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures, TwoDSparseStrategy
    from lightning_twod.models.dlrm import DLRM
    from lightning_twod.sparse.timing import PhaseTimer

    timer = PhaseTimer()
    allreduce_hook = W.timed_allreduce_hook(timer)
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    other_node = [r for r in range(world) if r // local != dist.get_rank() // local]

    class TimedTwoD(TwoDSparseStrategy):
        rounds = 0

        def setup(self, trainer) -> None:
            super().setup(trainer)
            for module in self.sparse_modules.values():
                module.timer = timer
            self.model.register_comm_hook(None, allreduce_hook)

        def sparse_step(self) -> None:
            with timer.phase("sparse_update"):
                super().sparse_step()

        def reduce_replicas(self, wait=None) -> int:
            self.rounds += 1
            with timer.phase("cross_group"):
                return super().reduce_replicas(wait)

    strategy = TimedTwoD(shard_group_size=cell["shard"], placement=cell["placement"], sync_interval=cell["interval"],
                         sync_dtype=cell["dtype"], sync_overlap=cell["overlap"], sparse_optimizer="rowwise_adagrad",
                         sparse_lr=work.sparse_lr, sparse_eps=work.sparse_eps, pipeline=cell.get("pipeline", False),
                         sharding=cell.get("sharding"), memory_per_rank_gb=work.memory_gb,
                         planner_batch_size=work.batch, links=cell.get("links", "auto"))

    def probe() -> dict:
        reducer, counter = strategy.reducer, strategy.byte_counter
        seconds = {f"{name}_s": value for name, value in (reducer.seconds if reducer else {}).items()}
        seconds.update({f"part_{name}": value for name, value in (reducer.parts if reducer else {}).items()})
        return {"rounds": strategy.rounds if reducer is not None and reducer.groups else 0, **seconds,
                "payload_bytes": reducer.bytes_sent if reducer else 0,
                **({f"round_memory_{k}": v for k, v in reducer.memory().items()} if reducer else {}),
                "replica_sync_bytes": counter.by_name().get("replica_sync", 0),
                "cross_node_bytes": counter.total(peers=other_node), "all_bytes": counter.total()}

    window = Window(cell["warmup"], cell["steps"], timer, probe)

    class BenchDLRM(TimedSteps, DLRM):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=work.dense_lr)

    class BenchBare(TimedSteps, pl.LightningModule):
        """``workload.py``'s bare model: the lookup's pooled rows ``[B, tables * dim]`` -> one linear layer."""

        def __init__(self) -> None:
            super().__init__()
            self.sparse = EmbeddingBagCollection([EmbeddingTableConfig(f"t_{k}", rows, work.dim, [k])
                                                  for k, rows in zip(work.keys, work.table_rows, strict=True)])
            self.head = W.bare_head(work)

        def forward(self, batch):
            return self.head(self.sparse(batch["sparse"]).values()).squeeze(1)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=work.dense_lr)

    total = cell["warmup"] + cell["steps"]
    data = [{"dense": d, "sparse": SparseFeatures(work.keys, v, n), "label": y} for d, v, n, y in batches[:total]]
    torch.manual_seed(work.seed)
    if work.model == "bare":
        model = BenchBare()
    else:
        model = BenchDLRM(table_rows=work.table_rows, embedding_dim=work.dim, num_dense=W.NUM_DENSE,
                          bottom_mlp=work.bottom, top_mlp=work.top, lr=work.dense_lr)
    model.timer, model.clock = timer, window
    trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=world // local, strategy=strategy,
                         max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None, collate_fn=lambda b: b))
    groups = strategy.mesh_groups
    plan = strategy.sharding_plan
    report = {**window.report(), "loss": model.last_loss, "rank": dist.get_rank(),
              "shard_ranks": groups.shard_ranks, "replica_ranks": groups.replica_ranks,
              "kernels": sorted({type(r.kernel).__name__ for r in strategy._replicated}),
              "dense_marks": allreduce_hook.marks[-cell["steps"]:],
              "group_sizes": {t: ts.size_in(plan.shard_group_size) if ts.sharding_type.value != "data_parallel" else 0
                              for tables in plan.modules.values() for t, ts in tables.items()}}
    if strategy.reducer is not None and strategy.reducer.groups:
        from lightning_twod.replication import WIRE_DTYPES

        plain_for_round(report, WIRE_DTYPES[cell["dtype"]], strategy.mesh_groups.replica)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True, help="the job's JSON (written by scaling.py)")
    from lightning_twod.distributed import destroy_process_groups_at_exit

    destroy_process_groups_at_exit()
    run_job(parser.parse_args().job, run_twod_cell)


if __name__ == "__main__":
    main()
