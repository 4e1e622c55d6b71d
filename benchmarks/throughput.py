"""Training throughput on CPU: ``twod_sparse`` 2x2 and 1x4 vs TorchRec 1D vs Lightning DDP.

The same synthetic DLRM workload (``workload.py``: tables, batch, steps, optimizers, the very same
batches) on ``world`` CPU processes with gloo, trained by:

* ``twod_2x2``    Lightning + ``TwoDSparseStrategy(shard_group_size=2, pipeline=False)``: 2 replica groups
  of 2 ranks, each batch's ids sent in its forward;
* ``twod_1x4``    Lightning + ``TwoDSparseStrategy(shard_group_size=4, pipeline=False)``: 1D, every table
  on one rank;
* ``twod_2x2_pipelined``, ``twod_1x4_pipelined`` the same with ``pipeline=True`` (the default): batch
  ``i + 1``'s ids travel while batch ``i`` trains; ``input_dist`` is then what the forward still waits
  for, and ``input_dist_ahead`` the worker thread's time on them (hidden, not part of the step);
* ``twod_fabric_1x4`` the same in a hand-written Lightning Fabric loop (``TwoDSparseFabricStrategy``):
  what the Trainer's loop adds per step is the difference to ``twod_1x4``;
* ``torchrec_1d`` TorchRec 1.8.0 ``DistributedModelParallel``, table-wise (``torchrec_worker.py``,
  in ``benchmarks/.venv-torchrec``, made by ``setup_torchrec.sh``);
* ``ddp``         Lightning ``DDPStrategy``: every table replicated on every rank as
  ``nn.EmbeddingBag(sparse=True)``; DDP all-reduces the sparse gradients.

Every run is ``world`` fresh processes launched like torchrun (``RANK``, ``WORLD_SIZE``, ...).
Runs are interleaved, round after round in rotated order, so that drift of a shared machine
cancels in the ratios, which are taken between runs of the same round. Per run: samples/s (global
batch / wall time per step, Lightning's loop included), and a per-step breakdown in ms.

    python benchmarks/throughput.py --rounds 3 --json benchmarks/results/throughput.json --plot benchmarks/out/throughput.png

The JSON (small, what ``benchmarks/results/README.md``'s tables are made from) is kept in git; the
figure goes to ``benchmarks/out`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # workload.py; lightning_twod when not installed
import workload as W  # noqa: E402
from timed_steps import TimedSteps  # noqa: E402

SYSTEMS = ("twod_2x2", "twod_1x4", "twod_2x2_pipelined", "twod_1x4_pipelined", "twod_fabric_1x4", "torchrec_1d",
           "ddp")
TORCHREC_PYTHON = os.path.join(HERE, ".venv-torchrec", "bin", "python")
PHASES = ("input_check", "input_dist", "lookup", "output_dist", "forward", "output_dist_backward",
          "lookup_backward", "dense_allreduce", "dense_wait", "backward", "sparse_update", "cross_group",
          "optimizer", "input_dist_ahead")


# ----------------------------------------------------------------------------- Lightning workers
def _lightning_worker(system: str, work: W.Workload, batches_path: str, out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_twod import SparseFeatures, TwoDSparseStrategy
    from lightning_twod.distributed import destroy_process_groups_at_exit
    from lightning_twod.models.dlrm import DLRM
    from lightning_twod.sparse.optimizers import SparseOptimizerConfig, sparse_update
    from lightning_twod.sparse.timing import PhaseTimer

    destroy_process_groups_at_exit()  # the DDP baseline too: no rank may abort at exit after its report
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    timer = PhaseTimer()
    clock = W.StepClock(work, timer)

    timed_allreduce = W.timed_allreduce_hook(timer)

    class SparseBags(nn.Module):
        """The DDP baseline's tables: plain ``nn.EmbeddingBag(sparse=True)``, replicated."""

        def __init__(self) -> None:
            super().__init__()
            self.keys = work.keys
            self.bags = nn.ModuleList(nn.EmbeddingBag(work.rows, work.dim, mode="sum", sparse=True)
                                      for _ in work.keys)
            for bag in self.bags:
                nn.init.uniform_(bag.weight, -work.rows ** -0.5, work.rows ** -0.5)

        def forward(self, features: SparseFeatures) -> dict:
            out = {}
            for key, bag in zip(self.keys, self.bags):
                ids, lengths, _ = features[key]
                offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)[:-1]])
                out[key] = bag(ids, offsets)
            return out

    class AdamWithRowwiseAdagrad(torch.optim.Adam):
        """Adam for dense parameters; row-wise AdaGrad (``lightning_twod.sparse.optimizers``) for sparse gradients."""

        def __init__(self, dense, sparse) -> None:
            super().__init__([{"params": dense}, {"params": sparse}], lr=work.dense_lr)
            self.rows = SparseOptimizerConfig("rowwise_adagrad", work.sparse_lr, work.sparse_eps)
            self.row_state = [(p, torch.zeros(p.shape[0])) for p in sparse]

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for param, state in self.row_state:
                if param.grad is not None:
                    grad = param.grad.coalesce()
                    sparse_update(self.rows, param.data, state, grad.indices()[0], grad.values())
                    param.grad = None
            super().step()
            return loss

    class BenchDLRM(TimedSteps, DLRM):
        def __init__(self) -> None:
            rows = 1 if system == "ddp" else work.rows  # the DDP baseline replaces the collection
            super().__init__(table_rows=[rows] * work.num_tables, embedding_dim=work.dim, num_dense=W.NUM_DENSE,
                             bottom_mlp=work.bottom, top_mlp=work.top, lr=work.dense_lr)
            self.timer, self.clock = timer, clock
            if system == "ddp":
                self.sparse = SparseBags()

        def configure_optimizers(self):
            if system != "ddp":
                return torch.optim.Adam(self.parameters(), lr=work.dense_lr)
            sparse = list(self.sparse.parameters())
            dense = [p for p in self.parameters() if all(p is not s for s in sparse)]
            return AdamWithRowwiseAdagrad(dense, sparse)

    class TimedTwoD(TwoDSparseStrategy):
        def setup(self, trainer) -> None:
            super().setup(trainer)
            for module in self.sparse_modules.values():
                module.timer = timer
            self.model.register_comm_hook(None, timed_allreduce)

        def sparse_step(self) -> None:
            with timer.phase("sparse_update"):
                super().sparse_step()

        def reduce_replicas(self, wait=None) -> int:
            with timer.phase("cross_group"):
                return super().reduce_replicas(wait)

    class TimedDDP(DDPStrategy):
        def setup(self, trainer) -> None:
            super().setup(trainer)
            self.model.register_comm_hook(None, timed_allreduce)

    raw = W.load_batches(batches_path, rank)
    lengths = torch.ones(work.num_tables * work.batch, dtype=torch.int64)
    batches = [{"dense": d, "sparse": SparseFeatures(work.keys, i.flatten(), lengths), "label": y} for d, i, y in raw]
    torch.manual_seed(work.seed)
    model = BenchDLRM()
    if system == "ddp":
        strategy = TimedDDP(process_group_backend="gloo")
    else:
        strategy = TimedTwoD(shard_group_size=2 if system.startswith("twod_2x2") else work.world,
                             pipeline=system.endswith("_pipelined"),
                             sparse_optimizer="rowwise_adagrad", sparse_lr=work.sparse_lr,
                             sparse_eps=work.sparse_eps, sync_interval=1)
    trainer = pl.Trainer(accelerator="cpu", devices=work.world, strategy=strategy, max_steps=len(batches),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False)
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    extra = {"loss": model.last_loss}
    if system != "ddp":
        extra["kernels"] = sorted({type(r.kernel).__name__ for r in strategy._replicated})
        # sparse_update is timed around the whole sparse step: take the reduction out of it
    W.write_report(out_dir, rank, clock.report(system, rank, extra))


def _fabric_worker(work: W.Workload, batches_path: str, out_dir: str) -> None:
    """``twod_fabric_1x4``: the DLRM of the Lightning workers in a plain Fabric loop, 1D."""
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from lightning_twod import SparseFeatures, TwoDSparseFabricStrategy
    from lightning_twod.models.dlrm import DLRM
    from lightning_twod.sparse.timing import PhaseTimer

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    timer = PhaseTimer()
    clock = W.StepClock(work, timer)
    strategy = TwoDSparseFabricStrategy(shard_group_size=work.world, sparse_optimizer="rowwise_adagrad",
                                        sparse_lr=work.sparse_lr, sparse_eps=work.sparse_eps, sync_interval=1)
    fabric = Fabric(accelerator="cpu", devices=work.world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(work.seed)
    model = DLRM(table_rows=[work.rows] * work.num_tables, embedding_dim=work.dim, num_dense=W.NUM_DENSE,
                 bottom_mlp=work.bottom, top_mlp=work.top, lr=work.dense_lr)
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=work.dense_lr))
    for module in strategy.sparse_modules.values():
        module.timer = timer
    model._forward_module.register_comm_hook(None, W.timed_allreduce_hook(timer))
    lengths = torch.ones(work.num_tables * work.batch, dtype=torch.int64)
    loss = None
    for step, (dense, ids, label) in enumerate(W.load_batches(batches_path, rank)):
        batch = {"dense": dense, "sparse": SparseFeatures(work.keys, ids.flatten(), lengths), "label": label}
        clock.step_begin(step)
        with timer.phase("forward"):
            loss = F.binary_cross_entropy_with_logits(model(batch), batch["label"])
        with timer.phase("backward"):
            fabric.backward(loss)
        with timer.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        clock.step_end(step)
    extra = {"loss": float(loss), "kernels": sorted({type(r.kernel).__name__ for r in strategy._replicated})}
    W.write_report(out_dir, rank, clock.report("twod_fabric_1x4", rank, extra))


# ----------------------------------------------------------------------------- orchestration
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(system: str, work: W.Workload, batches: str, timeout: float = 900, pyspy: str | None = None) -> dict:
    """``world`` processes of one system; the per-rank reports, aggregated."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(work.world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(work.world),
                       LOCAL_WORLD_SIZE=str(work.world), NODE_RANK="0", GROUP_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            if system == "torchrec_1d":
                cmd = [TORCHREC_PYTHON, os.path.join(HERE, "torchrec_worker.py"), "--workload", work.to_json(),
                       "--batches", batches, "--out", out]
                env.pop("PYTHONPATH")  # the TorchRec environment must not see the project's packages
            else:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--workload", work.to_json(),
                       "--batches", batches, "--out", out]
            if pyspy and rank == 0:  # sample rank 0's Python and native stacks (collapsed-stack text)
                spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
                cmd = [spy if os.path.exists(spy) else "py-spy", "record", "--native", "--format", "raw", "--rate", "200",
                       "-o", os.path.join(pyspy, f"{system}.txt"), "--", *cmd]
            log = open(os.path.join(out, f"log{rank}.txt"), "w")
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
        deadline = time.time() + timeout
        failed = None
        while failed is None and any(proc.poll() is None for proc, _ in procs):
            # a rank that dies leaves the others blocked in a collective: stop them all at once
            failed = next(((rank, proc.returncode) for rank, (proc, _) in enumerate(procs)
                           if proc.returncode not in (None, 0)), None)
            if failed is None and time.time() > deadline:
                failed = (0, "timeout")
            time.sleep(0.2)
        failed = failed or next(((rank, proc.returncode) for rank, (proc, _) in enumerate(procs)
                                 if proc.returncode != 0), None)
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        if failed is not None:
            rank, code = failed
            with open(os.path.join(out, f"log{rank}.txt")) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"{system}: rank {rank} exited with {code}:\n{tail}")
        reports = []
        for rank in range(work.world):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                reports.append(json.load(f))
    return aggregate(reports, work)


def aggregate(reports: list[dict], work: W.Workload) -> dict:
    step_ms = max(r["step_ms"] for r in reports)  # every rank waits for the slowest in the collectives
    names = sorted({n for r in reports for n in r["phases_ms"]})
    phases = {n: statistics.mean(r["phases_ms"].get(n, 0.0) for r in reports) for n in names}
    if "cross_group" in phases and "sparse_update" in phases:
        phases["sparse_update"] -= phases["cross_group"]  # timed around the whole sparse step
    return {"system": reports[0]["system"], "step_ms": step_ms,
            "samples_per_s": work.world * work.batch / (step_ms / 1e3),
            "phases_ms": phases, "loss": reports[0].get("loss"), "kernels": reports[0].get("kernels"),
            "step_ms_per_rank": [r["step_ms"] for r in reports],
            "cpu_ms_per_rank": [r["cpu_ms"] for r in reports], "cpu_ms": statistics.mean(r["cpu_ms"] for r in reports)}


def benchmark(work: W.Workload, systems: list[str], rounds: int, log=print, pyspy: str | None = None) -> dict:
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        batches = os.path.join(tmp, "batches.pt")
        W.make_batches(work, batches)
        for r in range(rounds):
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            for system in order:
                result = run_once(system, work, batches, pyspy=pyspy)
                result["round"] = r
                runs[system].append(result)
                log(f"round {r} {system:<18} {result['step_ms']:8.1f} ms/step {result['samples_per_s']:9.0f} samples/s "
                    f"{result['cpu_ms']:7.1f} CPU ms/step/rank, loss {result['loss']:.4f}")
    summary = {}
    for system, results in runs.items():
        summary[system] = {
            "samples_per_s": statistics.median(x["samples_per_s"] for x in results),
            "step_ms": statistics.median(x["step_ms"] for x in results),
            "step_ms_rounds": [x["step_ms"] for x in results],
            "cpu_ms": statistics.median(x["cpu_ms"] for x in results),
            "phases_ms": {n: statistics.median(x["phases_ms"].get(n, 0.0) for x in results)
                          for n in sorted({n for x in results for n in x["phases_ms"]})},
            "kernels": results[0]["kernels"],
        }
    ratios = {}
    for a in systems:
        for b in systems:
            if a != b:  # per round (adjacent runs), then the median: drift cancels
                per_round = [x["samples_per_s"] / y["samples_per_s"] for x, y in zip(runs[a], runs[b])]
                ratios[f"{a}/{b}"] = statistics.median(per_round)
    return {"workload": json.loads(work.to_json()), "rounds": rounds, "systems": systems, "summary": summary,
            "ratios": ratios, "runs": runs}


def print_table(result: dict, log=print) -> None:
    systems = result["systems"]
    summary = result["summary"]
    log(f"{'system':<18} {'samples/s':>10} {'ms/step':>8} {'CPU ms':>7}  " + " ".join(f"{p[:10]:>10}" for p in PHASES))
    for s in systems:
        row = summary[s]
        phases = " ".join(f"{row['phases_ms'].get(p, float('nan')):>10.2f}" for p in PHASES)
        log(f"{s:<18} {row['samples_per_s']:>10.0f} {row['step_ms']:>8.1f} {row['cpu_ms']:>7.1f}  {phases}")
    for a in systems:
        for b in systems:
            if a != b and a.startswith("twod"):
                log(f"throughput {a} / {b}: {result['ratios'][f'{a}/{b}']:.2f}x")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems, summary = result["systems"], result["summary"]
    work = result["workload"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1, 1.6]})
    values = [summary[s]["samples_per_s"] for s in systems]
    left.bar(systems, values, color=["#1f77b4", "#6baed6", "#d62728", "#7f7f7f"][: len(systems)])
    for i, s in enumerate(systems):
        for v in summary[s]["step_ms_rounds"]:
            left.plot(i, work["world"] * work["batch"] / (v / 1e3), "k.", ms=4)
    left.set_ylabel("samples / s (median of rounds; dots: each round)")
    left.set_title("training throughput, 4 CPU processes (gloo)")
    stacks = [("input_check", "input check"), ("input_dist", "input dist"), ("lookup", "lookup"),
              ("output_dist", "output dist"), ("forward_rest", "forward, dense"),
              ("output_dist_backward", "output dist bwd"), ("lookup_backward", "lookup bwd (+fused update)"),
              ("dense_allreduce", "dense all-reduce, waited"), ("backward_rest", "backward, rest"),
              ("sparse_update", "sparse update"), ("cross_group", "cross-group reduction"),
              ("optimizer_rest", "dense optimizer"), ("other", "loop / other")]
    bottoms = [0.0] * len(systems)
    colors = plt.get_cmap("tab20").colors
    for k, (key, label) in enumerate(stacks):
        heights = [breakdown(summary[s])[key] for s in systems]
        right.barh(systems, heights, left=bottoms, color=colors[k % len(colors)], label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    right.invert_yaxis()
    right.set_xlabel("ms per step (median of rounds)")
    right.set_title("per-step breakdown")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=5)
    fig.suptitle(f"{work['num_tables']} tables x {work['rows']:,} x {work['dim']}, {work['batch']} samples/rank, "
                 f"{work['world']} ranks, {result['rounds']} interleaved rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def breakdown(row: dict) -> dict[str, float]:
    """Disjoint parts of a step (ms): the measured phases, and what is left of each enclosing phase.

    ``dense_allreduce`` is what the step waited for DDP's all-reduce after the backward's own work
    (``dense_wait``, ``workload.timed_allreduce_hook``); records made before that was timed have only
    the span from its first bucket to its last, which encloses other backward parts, and give that.
    """
    p = row["phases_ms"]
    get = lambda k: p.get(k, 0.0)  # noqa: E731
    sparse_fwd = sum(get(k) for k in ("input_check", "input_dist", "lookup", "output_dist"))
    dense_wait = get("dense_wait") if "dense_wait" in p else get("dense_allreduce")
    bwd_parts = get("output_dist_backward") + get("lookup_backward") + dense_wait
    opt_parts = get("sparse_update") + get("cross_group")
    out = {k: get(k) for k in ("input_check", "input_dist", "lookup", "output_dist", "output_dist_backward",
                               "lookup_backward", "sparse_update", "cross_group")}
    out["dense_allreduce"] = dense_wait
    out["forward_rest"] = max(0.0, get("forward") - sparse_fwd)
    out["backward_rest"] = max(0.0, get("backward") - bwd_parts)
    out["optimizer_rest"] = max(0.0, get("optimizer") - opt_parts)
    out["other"] = max(0.0, row["step_ms"] - get("forward") - get("backward") - get("optimizer"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024, help="samples per rank")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write the plot (PNG) here")
    parser.add_argument("--pyspy", help="folder: record rank 0 of every run with py-spy (raw collapsed stacks)")
    parser.add_argument("--replot", help="only redraw --plot from this JSON of an earlier run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "twod_fabric_1x4":
            _fabric_worker(W.Workload.from_json(args.workload), args.batches, args.out)
        else:
            _lightning_worker(args.worker, W.Workload.from_json(args.workload), args.batches, args.out)
        return
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    if "torchrec_1d" in systems and not os.path.exists(TORCHREC_PYTHON):
        subprocess.run(["bash", os.path.join(HERE, "setup_torchrec.sh")], check=True)
    work = W.Workload(num_tables=args.tables, rows=args.rows, dim=args.dim, batch=args.batch, world=args.world,
                      steps=args.steps, warmup=args.warmup)
    print(f"workload: {work.to_json()}", flush=True)
    start = time.time()
    if args.pyspy:
        os.makedirs(args.pyspy, exist_ok=True)
    result = benchmark(work, systems, args.rounds, log=lambda m: print(m, flush=True), pyspy=args.pyspy)
    result["machine"] = machine()
    result["seconds"] = time.time() - start
    print_table(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


def machine() -> dict:
    import platform

    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_at_end": os.getloadavg()}


if __name__ == "__main__":
    main()
