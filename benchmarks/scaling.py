"""2D vs 1D on the two-node testbed: ``twod_sparse`` layouts and TorchRec, per link rate.

Every configuration ("cell") trains the same DLRM (``workload.py``) on the same batches on 4 ranks,
2 per network namespace of ``testbed.two_nodes``, the namespaces joined by a link shaped to each
rate. Workloads: ``criteo`` (26 tables x 100,000 x 64, one power-law id per feature, 4,096 samples
per rank) and ``pooled`` (8 tables x 100,000 x 64, bags of 1-19 ids, 1,024 samples per rank), and
``criteo-bare`` and ``pooled-bare``: the same tables and ids with the bare model (nothing before the
lookup, one linear layer after it: the embedding path alone).

* ``twod MxS``: ``TwoDSparseStrategy`` with M replica groups of shard groups of S ranks: ``1x4``
  (1D), ``2x2c`` (contiguous: a shard group per node), ``2x2s`` (strided: a replica group per
  node), ``4x1``; intervals 1, 8, 32; ``overlap`` (``sync_overlap=True``) or blocking; ``fp32`` or
  ``bf16`` payload, and ``int8`` for ``2x2c`` overlapped at the longer intervals; each with
  ``pipeline=False``; ``... pipelined``: the 1D cell and the blocking fp32 cells of the first
  interval with ``pipeline=True`` (input dist of the next batch during this one);
* ``bound 2x2c no reduction``, ``bound 4x1 no reduction``: the same training with no round in the
  timed window (rows are tracked as usual), what a reduction that cost nothing would give; the
  target lines compare with it, so that a page says when no reduction could meet a target here;
* ``torchrec dmp 1d``: TorchRec 1.8.0 ``DistributedModelParallel``, table-wise;
* ``torchrec dmpc-default`` / ``dmpc-interhost``: ``DMPCollection``, sharding groups of 2, its
  default placement / ``use_inter_host_allreduce=True``, ``sync()`` every 1 or 8 steps.

One torchrun job per (round, rate, workload, family) runs its cells one after another in the
same processes (``scaling_workers.py``, ``torchrec_collection_worker.py``), each cell with a few
untimed steps and then a whole number of reduction intervals timed; rounds repeat the grid with the
order changed (``round_order``: no cell follows the same cell in every round, since the cells of a job
share its processes), and ratios are taken between cells of the same round. Every finished cell is a line
of the cache (JSONL): an interrupted run resumes where it stopped.

    python benchmarks/scaling.py --rounds 2 [--workloads criteo pooled] [--rates 1gbit 10gbit unshaped]
    python benchmarks/scaling.py --quick --rates unshaped --cells "twod 1x4" "2x2c k2 overlap"

Writes ``scaling.md`` to ``--out-dir`` (default ``benchmarks/results``, in git), and ``scaling.json``
(every cell of every round) and ``scaling.png`` to its twin under ``benchmarks/out`` (git-ignored;
beside the page when ``--out-dir`` is not under ``benchmarks/results``: ``outputs.py``). Needs
root (network namespaces).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]
import throughput  # noqa: E402  (breakdown: the disjoint parts of a step)
import workload as W  # noqa: E402

from benchmarks import testbed  # noqa: E402
from benchmarks.outputs import figure_line, raw_dir  # noqa: E402
from lightning_twod.planner.link_cache import CACHE_ENV  # noqa: E402

#: memory_per_rank_gb of the skewed workload: the skewed model's large table does not fit twice (a global
#: layout of groups of 2 needs 2.1 GiB a rank), once it does, with the small tables in groups of 2 (1.4 GiB)
PER_TABLE_BUDGET_GB = 1.75
WORKLOADS = {"criteo": W.Workload(num_tables=26, rows=100_000, dim=64, batch=4096),
             "pooled": W.Workload(num_tables=8, rows=100_000, dim=64, batch=1024, min_ids=1, max_ids=19),
             # one table of 4 M rows (1 GiB) and 26 Criteo-like ones: per_table.py's
             "skewed": W.Workload(num_tables=27, rows=100_000, dim=64, batch=4096, big_rows=4_000_000,
                                memory_gb=PER_TABLE_BUDGET_GB)}
QUICK = {"criteo": W.Workload(num_tables=4, rows=2_000, dim=16, batch=128, bottom=[32], top=[32, 16]),
         "pooled": W.Workload(num_tables=3, rows=2_000, dim=16, batch=64, min_ids=1, max_ids=5, bottom=[32],
                              top=[32, 16]),
         "skewed": W.Workload(num_tables=4, rows=2_000, dim=16, batch=128, bottom=[32], top=[32, 16], big_rows=20_000)}
#: workloads that also run with the bare model (``workload.py``: nothing before the lookup, one linear layer
#: after it), as ``<name>-bare``: the same tables and ids
BARE = ("criteo", "pooled", "skewed")
WORKLOADS.update({f"{name}-bare": replace(WORKLOADS[name], model="bare") for name in BARE})
QUICK.update({f"{name}-bare": replace(QUICK[name], model="bare") for name in BARE})
#: what the grid runs unless told otherwise (the skewed workload is per_table.py's)
DEFAULT_WORKLOADS = ("criteo", "pooled")
#: links of the calibrated per-table cell, per rate (``calibration.links_for`` writes them)
CALIBRATED_LINKS = str(HERE.parent / "build" / "calibration" / "links_{rate}.yaml")
RATES = ("1gbit", "10gbit", "unshaped")
NEVER = 10**6  # the interval of a bound cell: its first round would come long after its last step
BOUNDS = ("2x2c", "4x1")  # layouts timed without any round: what a reduction that cost nothing would give
LAYOUTS = {"1x4": (4, "contiguous"), "2x2c": (2, "contiguous"), "2x2s": (2, "strided"), "4x1": (1, "contiguous")}
TORCHREC_PYTHON = HERE / ".venv-torchrec" / "bin" / "python"
SCRIPTS = {"twod": HERE / "scaling_workers.py", "torchrec": HERE / "torchrec_collection_worker.py"}
TARGETS = {"vs_1d": 2.0, "vs_torchrec_1d": 1.7, "vs_dmpc": 2.5, "pooled_vs_dmpc": 1.5, "round_vs_plain": 1.3,
           "exposed_share": 0.25}
NAMES = {"input_check": "input check", "input_dist": "input dist", "lookup": "lookup", "output_dist": "output dist",
         "forward_rest": "forward, dense", "output_dist_backward": "output dist bwd",
         "lookup_backward": "lookup bwd (+fused update)", "dense_allreduce": "dense all-reduce, waited",
         "backward_rest": "backward, rest", "sparse_update": "sparse update", "cross_group": "cross-group reduction",
         "optimizer_rest": "dense optimizer", "other": "loop / other"}


# ----------------------------------------------------------------------------- the grid
def window(interval: int, overlap: bool, quick: bool) -> tuple[int, int]:
    """(untimed, timed) steps: a whole number of intervals timed, at least 16 steps (4 quick); with
    overlap the warm-up holds a whole interval, so that every timed round applies one in flight.
    A bound cell (interval ``NEVER``) times the least number of steps, none of them with a round,
    after the warm-up of an overlapped interval-8 cell: the same steps as the cell it bounds."""
    least, warm = (4, 2) if quick else (16, 3)
    if interval == NEVER:
        return (warm if quick else 8), least
    steps = -(-max(least, interval) // interval) * interval
    return (max(warm, interval) if overlap else warm), steps


def grid(quick: bool) -> list[dict]:
    """Every cell of one workload and rate, family ``twod`` first."""
    intervals, torchrec_intervals = ((2,), (2,)) if quick else ((1, 8, 32), (1, 8))
    cells = [dict(name="twod 1x4", family="twod", system="twod", layout="1x4", shard=4, placement="contiguous",
                  interval=1, overlap=False, dtype="fp32")]
    for layout, (shard, placement) in LAYOUTS.items():
        for interval in intervals:
            for overlap in (False, True):
                int8 = layout == "2x2c" and overlap and interval > intervals[0]
                for dtype in ("fp32", "bf16", "int8") if int8 else ("fp32", "bf16"):
                    if shard < 4:
                        name = f"twod {layout} k{interval} {'overlap' if overlap else 'blocking'} {dtype}"
                        cells.append(dict(name=name, family="twod", system="twod", layout=layout, shard=shard,
                                          placement=placement, interval=interval, overlap=overlap, dtype=dtype))
    # pipeline=True (the default of the strategy; the cells above keep pipeline=False, as measured before it):
    # the 1D cell and the blocking fp32 2D cells at the first interval
    for base in [c for c in cells if c["layout"] == "1x4" or (c["interval"] == intervals[0] and not c["overlap"]
                                                                and c["dtype"] == "fp32")]:
        cells.append(dict(base, name=f"{base['name']} pipelined", pipeline=True))
    for layout in BOUNDS:
        shard, placement = LAYOUTS[layout]
        cells.append(dict(name=f"bound {layout} no reduction", family="twod", system="twod", layout=layout,
                          shard=shard, placement=placement, interval=NEVER, overlap=False, dtype="fp32"))
    for interval in (8, 32) if not quick else (2,):  # every table its own group size, chosen by the planner
        cells.append(dict(name=f"twod per-table auto k{interval} overlap bf16", family="twod", system="twod",
                          layout="per-table", shard="auto", placement="contiguous", interval=interval, overlap=True,
                          dtype="bf16"))
        # the layout the method intends for the skewed model, pinned: the large table 1D, the rest in groups of 2
        cells.append(dict(name=f"twod per-table pinned k{interval} overlap bf16", family="twod", system="twod",
                          layout="per-table", shard=2, placement="contiguous", interval=interval, overlap=True,
                          dtype="bf16", sharding={"t_cat_0": {"shard_group_size": 4}}))
    # the planner's choice on the links `lightning-twod calibrate` measured on the testbed at the cell's rate
    # (benchmarks/calibration.py keeps them), not on the short probe of each set-up
    interval = 2 if quick else 8
    cells.append(dict(name=f"twod per-table auto k{interval} overlap bf16 calibrated", family="twod", system="twod",
                      layout="per-table", shard="auto", placement="contiguous", interval=interval, overlap=True,
                      dtype="bf16", links=CALIBRATED_LINKS))
    cells.append(dict(name="torchrec dmp 1d", family="torchrec", system="torchrec_dmp", interval=1, overlap=False))
    for inter_host in (False, True):
        for interval in torchrec_intervals:
            cells.append(dict(name=f"torchrec dmpc-{'interhost' if inter_host else 'default'} k{interval}",
                              family="torchrec", system="torchrec_dmpc", shard=2, inter_host=inter_host,
                              interval=interval, overlap=False))
    for cell in cells:
        cell["warmup"], cell["steps"] = window(cell["interval"], cell["overlap"], quick)
    return cells


def at_least(cell: dict, steps: int) -> dict:
    """``cell`` timing at least ``steps`` steps, a whole number of its intervals (a bound cell, with no
    round, as many as asked)."""
    interval = 1 if cell["interval"] == NEVER else cell["interval"]
    return {**cell, "steps": max(cell["steps"], -(-steps // interval) * interval)}


def select(cells: list[dict], patterns: list[str] | None) -> list[dict]:
    return [c for c in cells if not patterns or any(re.search(p, c["name"]) for p in patterns)]


def fingerprint(work: W.Workload, cell: dict) -> str:
    """What makes a cached cell reusable: the workload and the cell itself."""
    text = json.dumps([asdict(work), cell], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def batch_folder(args, work: W.Workload) -> tuple[Path, W.Workload]:
    """Where a workload's batches are, and the workload with as many steps as any cell needs."""
    steps = max(c["warmup"] + at_least(c, getattr(args, "timed_steps", 0))["steps"] for c in grid(args.quick))
    work = replace(work, steps=steps)
    return args.work_dir / "batches" / fingerprint(work, {}), work


# ----------------------------------------------------------------------------- running
def read_cache(path: Path) -> dict[tuple, dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                done[(record["cell"]["fingerprint"], record["rate"], record["round"])] = record
    return done


def succeeded(record: dict | None) -> bool:
    """A cached cell that needs no rerun (failed ones run again)."""
    return record is not None and not any("error" in r for r in record["ranks"])


def watch(path: Path, stop: threading.Event) -> None:
    """Print each cell as its line reaches the cache (the job itself runs silently in its namespaces)."""
    seen = path.stat().st_size if path.exists() else 0
    while not stop.wait(2.0):
        if path.exists() and path.stat().st_size > seen:
            with path.open() as f:
                f.seek(seen)
                text = f.read()
            complete = text[:text.rfind("\n") + 1]  # a line still being written waits for the next look
            seen += len(complete.encode())
            for line in complete.splitlines():
                record = json.loads(line)
                row = aggregate(record)
                what = f"{row['step_ms']:9.1f} ms/step" if "step_ms" in row else f"FAILED: {row['error'][-300:]}"
                print(f"  round {record['round']} {record['rate']:<8} {record['workload']:<6} "
                      f"{record['cell']['name']:<34} {what}  (load {record['loadavg_after']})", flush=True)


def run_job(bed, family: str, name: str, work: W.Workload, cells: list[dict], meta: dict, args, batches: Path) -> None:
    job_dir = args.work_dir / "jobs" / f"r{meta['round']}-{meta['rate']}-{name}-{family}"
    job_dir.mkdir(parents=True, exist_ok=True)
    cells = [{**c, "links": c["links"].format(rate=meta["rate"])} if "links" in c else c for c in cells]
    job = {"workload": asdict(work), "batches": str(batches), "cells": cells, "out": str(args.cache), "meta": meta}
    (job_dir / "job.json").write_text(json.dumps(job, indent=1))
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(args.cache, stop), daemon=True)
    watcher.start()
    try:
        result = bed.run(SCRIPTS[family], ["--job", str(job_dir / "job.json")], nproc_per_node=2,
                         timeout=args.job_timeout, log_dir=job_dir, cwd=ROOT)
    finally:
        stop.set()
        watcher.join()
    if not result.ok:
        print(f"  job {job_dir.name} failed ({result.summary()}); its finished cells are kept. Logs: {job_dir}\n"
              + result.output(0)[-2000:], flush=True)


def run_grid(args, selection: dict[str, list[dict]], works: dict[str, W.Workload]) -> None:
    """Runs what the cache lacks, round by round, and records each round's load average."""
    for r in range(args.rounds):
        entry = {"round": r, "rates": args.rates, "workloads": args.workloads, "loadavg_before": loadavg(),
                 "started": time.time()}
        try:
            run_round(args, selection, works, r)
        finally:  # also when interrupted: the cells that finished are in the cache already
            entry.update(loadavg_after=loadavg(), finished=time.time())
            if entry["finished"] - entry["started"] > 1:
                with rounds_file(args).open("a") as f:
                    f.write(json.dumps(entry) + "\n")


def round_order(items: list, r: int) -> list:
    """``items`` in the order of round ``r``: every ``k``-th item (mod n) from item ``r k mod n``, ``k``
    the round's step among the numbers coprime to ``n``. A rotation keeps each item behind the same one
    in every round; a job's cells share its processes (what one leaves in memory, the next meets), so
    the step changes from round to round and so does what each cell follows (n = 5: steps 1, 2, 3)."""
    n = len(items)
    steps = [k for k in range(1, n) if math.gcd(k, n) == 1] or [1]
    k = steps[r % len(steps)]
    return [items[(r * k + i * k) % n] for i in range(n)]


def run_round(args, selection: dict[str, list[dict]], works: dict[str, W.Workload], r: int) -> None:
    """One round: per rate one testbed, on it one job per workload and family, in ``round_order``."""
    for rate in args.rates:
        done = read_cache(args.cache)
        todo = {(name, family): [c for c in cells if c["family"] == family
                                 and not succeeded(done.get((c["fingerprint"], rate, r)))]
                for name, cells in selection.items() for family in ("twod", "torchrec")}
        if not any(todo.values()):
            continue
        print(f"round {r}, {rate}: {sum(map(len, todo.values()))} cells (load {loadavg()})", flush=True)
        with testbed.two_nodes(rate=rate) as bed:
            jobs = [key for key, cells in todo.items() if cells]
            for name, family in round_order(jobs, r):
                cells = round_order(todo[(name, family)], r)
                batches, _ = batch_folder(args, works[name])
                run_job(bed, family, name, works[name], cells,
                        {"workload": name, "rate": rate, "round": r}, args, batches)


def rounds_file(args) -> Path:
    return args.cache.with_name(args.cache.stem + "_rounds.jsonl")


def rounds_meta(args) -> list[dict]:
    """The load average before and after each round, for every invocation that ran part of one."""
    path = rounds_file(args)
    entries = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sorted((e for e in entries if e["round"] < args.rounds), key=lambda e: (e["round"], e["started"]))


# ----------------------------------------------------------------------------- results
def aggregate(record: dict) -> dict:
    """One cell of one round from its ranks' reports: the slowest rank's pace, mean phases."""
    cell, ranks = record["cell"], record["ranks"]
    base = {"name": cell["name"], "round": record["round"], "cell_seconds": record.get("seconds"),
            "loadavg": [record["loadavg_before"], record["loadavg_after"]]}
    failed = next((r["error"] for r in ranks if "error" in r), None)
    if failed:
        return {**base, "error": failed}
    steps = ranks[0]["timed_steps"]
    counters = [r["counters"] for r in ranks]
    rounds = counters[0]["rounds"]
    spent = [sum(v for k, v in c.items() if k.endswith("_s")) for c in counters]  # time in reduction calls
    names = sorted({n for r in ranks for n in r["phases_ms"]})
    phases = {n: statistics.mean(r["phases_ms"].get(n, 0.0) for r in ranks) for n in names}
    if "sparse_update" in phases and "cross_group" in phases:
        phases["sparse_update"] -= phases["cross_group"]  # the strategy's sparse step holds the reduction
    row = {**base, "step_ms": max(r["step_ms"] for r in ranks),
           "step_ms_median": statistics.median(max(each) for each in zip(*(r["step_ms_each"] for r in ranks))),
           "cpu_ms": statistics.mean(r["cpu_ms"] for r in ranks), "phases_ms": phases, "loss": ranks[0]["loss"],
           "rounds": rounds, "reduction_ms_per_step": 1e3 * max(spent) / steps,
           # the reducer's calls by kind (launch, wait_and_apply, blocking) and by part (part_agree_rows,
           # part_pack, part_wait, part_apply), slowest rank, ms per step
           "reduction_parts_ms_per_step": {k.removesuffix("_s"): 1e3 * max(c.get(k, 0.0) for c in counters) / steps
                                           for k in sorted({k for c in counters for k in c
                                                            if k.endswith("_s") or k.startswith("part_")})},
           "thread_cpu_ms": statistics.mean([r["thread_cpu_ms"] for r in ranks if "thread_cpu_ms" in r] or [0.0])}
    if rounds:
        row["reduction_ms_per_round"] = 1e3 * max(spent) / rounds
        row["reduction_parts_ms_per_round"] = {k: v * steps / rounds for k, v in row["reduction_parts_ms_per_step"].items()}
        row["payload_bytes_per_round"] = max(c["payload_bytes"] for c in counters) / rounds
        if "replica_sync_bytes" in counters[0]:
            row["wire_bytes_per_round"] = max(c["replica_sync_bytes"] for c in counters) / rounds
    held = [c for c in counters if c.get("round_memory_elements")]
    if held:  # what the rounds hold besides the tables, bytes per replicated element (the rank holding most)
        row["round_bytes_per_element"] = max(c["round_memory_bytes"] / c["round_memory_elements"] for c in held)
    if "cross_node_bytes" in counters[0]:
        row["cross_node_bytes_per_step"] = max(c["cross_node_bytes"] for c in counters) / steps
    if "group_sizes" in ranks[0]:  # what the planner gave each table (the same on every rank)
        row["group_sizes"] = ranks[0]["group_sizes"]
    plains = [r["plain"] for r in ranks if "plain" in r]
    if plains:
        row["plain_ms"] = statistics.median(max(each) for each in zip(*(p["ms"] for p in plains)))
        row["plain_bytes"] = max(p["bytes"] for p in plains)
        if rounds and not cell["overlap"]:
            row["round_vs_plain"] = row["reduction_ms_per_round"] / row["plain_ms"]
    return row


def summarize(rows: list[dict]) -> dict:
    """Median over rounds of every number of one cell."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return {"error": rows[-1]["error"]}
    out = {"rounds_ok": len(ok), "step_ms_rounds": [r["step_ms"] for r in ok]}
    for key in ok[0]:
        if isinstance(ok[0][key], (int, float)) and key != "round":
            out[key] = statistics.median(r[key] for r in ok if isinstance(r.get(key), (int, float)))
    for key in ("phases_ms", "reduction_parts_ms_per_step", "reduction_parts_ms_per_round"):
        out[key] = {n: statistics.median(r.get(key, {}).get(n, 0.0) for r in ok) for n in ok[0].get(key, {})}
    return out


def compare(rows: dict[str, dict[int, dict]], summary: dict[str, dict]) -> dict:
    """The ratios of issue 12 section 5 for one workload and rate: per round, then the median."""
    def step(name, r):
        return rows.get(name, {}).get(r, {}).get("step_ms")

    def best(names):
        names = [n for n in names if "step_ms" in summary.get(n, {})]
        return min(names, key=lambda n: summary[n]["step_ms"]) if names else None

    def ratio(slow_names, fast):
        per_round = []
        for r in sorted(rows.get(fast, {})):
            slow = [step(n, r) for n in slow_names if step(n, r)]
            if slow and step(fast, r):
                per_round.append(min(slow) / step(fast, r))  # the best of the compared cells, same round
        return {"fast": fast, "slow": slow_names, "rounds": per_round,
                "median": statistics.median(per_round) if per_round else None}

    def with_bound(result, bounds):
        """``result`` and, under "bound", the same ratio for the fastest of ``bounds``."""
        fastest = best(bounds)
        if fastest:
            result["bound"] = ratio(result["slow"], fastest)
        return result

    cells = list(summary)
    two_d = [n for n in cells if n.startswith("twod") and "1x4" not in n]
    bounds = [n for n in cells if n.startswith("bound ")]
    out = {}
    top = best(two_d)
    if top:
        out["best_2d"] = top
        out["vs_1d"] = with_bound(ratio(["twod 1x4", "twod 1x4 pipelined"], top), bounds)
        out["vs_torchrec_1d"] = with_bound(ratio(["torchrec dmp 1d"], top), bounds)
    for k in (1, 8, 2):
        dmpc = [n for n in cells if n.startswith("torchrec dmpc") and n.endswith(f" k{k}")]
        for label, pool, limits in ((f"vs_dmpc_k{k}", two_d, bounds),
                                    (f"2x2_vs_dmpc_k{k}", [n for n in two_d if "2x2" in n],
                                     [n for n in bounds if "2x2" in n])):
            fast = best([n for n in pool if f" k{k} " in n])
            if fast and dmpc:
                out[label] = with_bound(ratio(dmpc, fast), limits)
    blocking = {n: summary[n]["round_vs_plain"] for n in cells if n.startswith("twod") and "round_vs_plain" in summary[n]}
    if blocking:
        out["round_vs_plain"] = blocking
    shares = {}
    for n in cells:
        sibling = n.replace(" overlap ", " blocking ")
        if " overlap " in n and "reduction_ms_per_round" in summary.get(sibling, {}):
            shares[n] = summary[n]["reduction_ms_per_round"] / summary[sibling]["reduction_ms_per_round"]
    if shares:
        out["exposed_share"] = shares
    return out


def largest_phases(row: dict, count: int = 3) -> str:
    parts = throughput.breakdown(row)
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{NAMES[k]} {v:.0f} ms" for k, v in top)


def verdicts(results: dict) -> list[str]:
    """One line per target of issue 12 section 5: met or missed, by how much, which phase holds it."""
    lines = []

    def ratio_line(what, workload, rate, key, target):
        res = results.get(workload, {}).get(rate)
        got = res and res["ratios"].get(key)
        if not got or got["median"] is None:
            return lines.append(f"* {what}: not measured in this run.")
        fast = res["summary"][got["fast"]]
        verdict = "**met**" if got["median"] >= target else "**missed**"
        slow = min(res["summary"][n]["step_ms"] for n in got["slow"] if "step_ms" in res["summary"].get(n, {}))
        note = "" if got["median"] >= target else (
            f"; it needs {slow / target:.0f} ms/step and takes {fast['step_ms']:.0f} "
            f"({fast['step_ms'] - slow / target:.0f} ms too many); largest phases of `{got['fast']}`: "
            f"{largest_phases(fast)}")
        bound = got.get("bound")
        if bound and bound["median"] is not None:
            note += (f"; with no round at all, `{bound['fast']}` gives {bound['median']:.2f}x"
                     + ("" if bound["median"] >= target else ", so no reduction can meet the target on this testbed"))
        lines.append(f"* {what} (target {target}x): `{got['fast']}` {got['median']:.2f}x "
                     f"(rounds: {', '.join(f'{x:.2f}' for x in got['rounds'])}) {verdict}{note}.")

    ratio_line("criteo, 1 Gbit/s: best twod 2D / twod 1D", "criteo", "1gbit", "vs_1d", TARGETS["vs_1d"])
    ratio_line("criteo, 1 Gbit/s: best twod 2D / TorchRec DMP 1D", "criteo", "1gbit", "vs_torchrec_1d",
               TARGETS["vs_torchrec_1d"])
    for k in (1, 8):
        ratio_line(f"criteo, 1 Gbit/s: best twod 2D at interval {k} / best DMPCollection at {k}", "criteo", "1gbit",
                   f"vs_dmpc_k{k}", TARGETS["vs_dmpc"])
    ratio_line("pooled, unshaped (one host): twod 2x2 at interval 8 / best DMPCollection at 8", "pooled", "unshaped",
               "2x2_vs_dmpc_k8", TARGETS["pooled_vs_dmpc"])
    for key, what, limit in (("round_vs_plain", "a blocking round / a plain all-reduce of its bytes", "at most"),
                             ("exposed_share", "exposed reduction time / the blocking round's time", "at most")):
        for workload, rates in results.items():
            for rate, res in rates.items():
                values = res["ratios"].get(key)
                if values:
                    worst = max(values, key=values.get)
                    met = sum(v <= TARGETS[key] for v in values.values())
                    lines.append(f"* {workload}, {rate}: {what} ({limit} {TARGETS[key]}): {met} of {len(values)} "
                                 f"cells meet it; median {statistics.median(values.values()):.2f}, worst "
                                 f"{values[worst]:.2f} (`{worst}`).")
    return lines


def report(args, selection) -> dict:
    done = read_cache(args.cache)
    results: dict[str, dict[str, dict]] = {}
    for name, cells in selection.items():
        for rate in args.rates:
            rows: dict[str, dict[int, dict]] = {}
            for cell in cells:
                for r in range(args.rounds):
                    record = done.get((cell["fingerprint"], rate, r))
                    if record:
                        rows.setdefault(cell["name"], {})[r] = aggregate(record)
            if rows:
                summary = {n: summarize(list(per_round.values())) for n, per_round in rows.items()}
                results.setdefault(name, {})[rate] = {"summary": summary, "ratios": compare(rows, summary),
                                                      "rounds": {n: list(v.values()) for n, v in rows.items()}}
    present = sum(len(rows) for rates in results.values() for res in rates.values() for rows in res["rounds"].values())
    expected = sum(len(cells) for cells in selection.values()) * len(args.rates) * args.rounds
    full = (not args.quick and not args.cells and set(args.workloads) == set(DEFAULT_WORKLOADS)
            and set(args.rates) == set(RATES) and present == expected)
    return {"complete_grid": full, "quick": args.quick, "cells": args.cells, "present": present, "expected": expected,
            "rounds": args.rounds, "rounds_meta": rounds_meta(args),
            "workloads": {n: asdict(w) for n, w in works_of(args).items()}, "rates": args.rates,
            "results": results, "verdicts": verdicts(results), "machine": throughput.machine()}


def mib(x, digits=1):
    return f"{x / 2**20:.{digits}f}" if isinstance(x, (int, float)) else ""


def fmt(x, digits=1):
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else ""


def write_markdown(data: dict, path: Path, figure: Path) -> None:
    if data["complete_grid"]:
        out = ["# Scaling on the two-node testbed", ""]
    elif data["quick"]:
        out = ["# Scaling on the two-node testbed: QUICK RUN (tiny tables; checks the harness, decides nothing)", ""]
    else:
        selected = " ".join(f"'{p}'" for p in data.get("cells") or [])
        which = f"`--cells {selected}`" if selected else f"{data.get('present')} of the grid's {data.get('expected')}"
        out = ["# Scaling on the two-node testbed: a selection of the grid", "",
               f"Only the cells below were run ({which} cell rounds; a cell has as many rounds as its `per round` "
               "column lists). The targets are judged on these cells; the full grid is `python "
               "benchmarks/scaling.py --rounds 2` without `--cells`.", ""]
    out += [ "Written by `benchmarks/scaling.py` (see its docstring and `benchmarks/results/README.md`). "
           f"Rounds: {data['rounds']}; every number is the median over rounds of one cell; ratios are medians of "
           "per-round ratios. ms/step = the timed window's wall time / its steps on the slowest rank (whole "
           "reduction intervals, so a round's cost is spread over its interval); median step = the median single "
           "step. Load average (1/5/15 min) of the machine before and after each round:", ""]
    for meta in data["rounds_meta"]:
        out.append(f"* round {meta['round']} ({', '.join(meta.get('workloads', []))} at "
                   f"{', '.join(meta.get('rates', []))}, "
                   f"{(meta['finished'] - meta['started']) / 60:.0f} min): {meta['loadavg_before']} -> "
                   f"{meta['loadavg_after']}")
    out += ["", "## Targets (issue 12, section 5)", "", *data["verdicts"], "", figure_line(path, figure, "scaling"), ""]
    for name, rates in data["results"].items():
        for rate, res in rates.items():
            out += [f"## {name}, {rate}", "", "| cell | ms/step | per round | median step | exposed reduction "
                    "ms/step | payload MiB/round | wire MiB/round | round ms | plain all-reduce ms | round / plain | "
                    "cross-node MiB/step | load avg per round |", "|---|" + "---:|" * 10 + "---|"]
            for cell, s in res["summary"].items():
                loads = "; ".join(f"{r['loadavg'][0]} -> {r['loadavg'][1]}" for r in res["rounds"][cell])
                if "error" in s:
                    out.append(f"| `{cell}` | failed: {s['error'].splitlines()[-1][:80]} |" + " |" * 9 + f" {loads} |")
                    continue
                per_round = ", ".join(fmt(x) for x in s["step_ms_rounds"])
                out.append(f"| `{cell}` | {fmt(s['step_ms'])} | {per_round} | {fmt(s.get('step_ms_median'))} | "
                           f"{fmt(s.get('reduction_ms_per_step'))} | {mib(s.get('payload_bytes_per_round'))} | "
                           f"{mib(s.get('wire_bytes_per_round'))} | {fmt(s.get('reduction_ms_per_round'))} | "
                           f"{fmt(s.get('plain_ms'))} | {fmt(s.get('round_vs_plain'), 2)} | "
                           f"{mib(s.get('cross_node_bytes_per_step'), 2)} | {loads} |")
            keys = list(NAMES)
            out += ["", "Per-step breakdown (ms, mean over ranks):", "",
                    "| cell | " + " | ".join(NAMES[k] for k in keys) + " |", "|---|" + "---:|" * len(keys)]
            for cell, s in res["summary"].items():
                if "error" not in s:
                    parts = throughput.breakdown(s)
                    out.append(f"| `{cell}` | " + " | ".join(fmt(parts[k]) for k in keys) + " |")
            ratios = {k: v for k, v in res["ratios"].items() if isinstance(v, dict) and "median" in v}
            if ratios:
                out += ["", "Throughput ratios (median of rounds): " + "; ".join(
                    f"{k}: `{v['fast']}` {fmt(v['median'], 2)}x" for k, v in ratios.items() if v["median"]), ""]
    path.write_text("\n".join(out) + "\n")


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    panels = [(name, rate) for name in results for rate in data["rates"] if rate in results[name]]
    if not panels:
        return
    rates = [r for r in data["rates"] if any(r in results[n] for n in results)]
    if len(panels) == len(results) * len(rates):  # every workload at every rate: rows = workloads
        shape, where = (len(results), len(rates)), {p: divmod(i, len(rates)) for i, p in enumerate(panels)}
    else:
        shape, where = (1, len(panels)), {p: (0, i) for i, p in enumerate(panels)}
    height = max(3.0, 0.2 * max(len(results[n][r]["summary"]) for n, r in panels))
    fig, axes = plt.subplots(*shape, figsize=(5.5 * shape[1], (height + 0.8) * shape[0]), squeeze=False)
    for (name, rate), (row, col) in where.items():
        ax, res = axes[row][col], results[name][rate]
        cells = [c for c, s in res["summary"].items() if "step_ms" in s]
        colors = ["#d62728" if c.startswith("torchrec") else "#6baed6" if "1x4" in c else "#1f77b4" for c in cells]
        ax.barh(cells, [res["summary"][c]["step_ms"] for c in cells], color=colors)
        for i, c in enumerate(cells):
            rounds = res["summary"][c]["step_ms_rounds"]
            ax.plot(rounds, [i] * len(rounds), "k.", ms=3)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=6)
        ax.set_xlabel("ms per step (median of rounds; dots: rounds)")
        ax.set_title(f"{name}, {rate}")
    fig.suptitle("twod_sparse (blue; 1D light) vs TorchRec (red)\n4 ranks on 2 namespaces"
                 + ("" if data["complete_grid"] else ", partial run"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(data: dict) -> None:
    for name, rates in data["results"].items():
        for rate, res in rates.items():
            print(f"\n{name}, {rate}:\n{'cell':<36} {'ms/step':>8} {'exposed':>8} {'MiB/rnd':>8} {'round':>8} "
                  f"{'plain':>8} {'r/plain':>7}")
            for cell, s in res["summary"].items():
                print(f"{cell:<36} {fmt(s.get('step_ms')):>8} {fmt(s.get('reduction_ms_per_step')):>8} "
                      f"{mib(s.get('payload_bytes_per_round')):>8} {fmt(s.get('reduction_ms_per_round')):>8} "
                      f"{fmt(s.get('plain_ms')):>8} {fmt(s.get('round_vs_plain'), 2):>7}"
                      + (f" FAILED {s['error'].splitlines()[-1][:60]}" if "error" in s else ""))
    print("\n" + "\n".join(data["verdicts"]))


def works_of(args) -> dict[str, W.Workload]:
    table = QUICK if args.quick else WORKLOADS
    return {name: table[name] for name in args.workloads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(DEFAULT_WORKLOADS))
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="tc rates (1gbit, ...) or unshaped")
    parser.add_argument("--quick", action="store_true", help="tiny tables, few steps, interval 2: checks the harness")
    parser.add_argument("--cells", nargs="+", help="only cells whose name matches one of these regular expressions")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results",
                        help="scaling.md (default benchmarks/results); scaling.json and .png: outputs.raw_dir")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "build" / "scaling",
                        help="batches, job files and node logs (default build/scaling, git-ignored)")
    parser.add_argument("--cache", type=Path, help="finished cells, JSON lines (default WORK_DIR/runs.jsonl)")
    parser.add_argument("--job-timeout", type=float, default=None, help="seconds per job (default 5 h; quick 600 s)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the outputs from the cache")
    parser.add_argument("--timed-steps", type=int, default=0,
                        help="time at least this many steps a cell (whole intervals; default: window()'s)")
    args = parser.parse_args(argv)
    args.cache = args.cache or args.work_dir / "runs.jsonl"
    # the links cache of the cells whose layout auto chooses: the work dir's (its ranks inherit it), so that
    # one sitting's first set-up measures and no sitting reads another's or the user's entry
    os.environ.setdefault(CACHE_ENV, str(args.work_dir / "links_cache"))
    args.job_timeout = args.job_timeout or (600 if args.quick else 5 * 3600)
    works = works_of(args)
    wanted = [at_least(cell, args.timed_steps) for cell in select(grid(args.quick), args.cells)]
    if not TORCHREC_PYTHON.exists() and any(c["family"] == "torchrec" for c in wanted):
        if args.quick:
            print(f"skipping the TorchRec cells: {TORCHREC_PYTHON.parent.parent} is missing "
                  "(bash benchmarks/setup_torchrec.sh)", flush=True)
            wanted = [c for c in wanted if c["family"] != "torchrec"]
        else:
            subprocess.run(["bash", str(HERE / "setup_torchrec.sh")], check=True)
    selection = {name: [{**c, "fingerprint": fingerprint(work, c)} for c in wanted] for name, work in works.items()}
    if not args.report_only:
        try:
            testbed.preflight()
        except testbed.TestbedUnavailable as error:
            print(f"scaling.py: {error}", file=sys.stderr)
            return 2
        args.cache.parent.mkdir(parents=True, exist_ok=True)
        for name, work in works.items():
            folder, long = batch_folder(args, work)
            if not (folder / f"rank{work.world - 1}.pt").exists():
                print(f"generating the {name} batches ({long.steps} steps) in {folder}", flush=True)
                W.make_rank_batches(long, str(folder))
        print(f"{len(wanted)} cells x {len(works)} workloads x {len(args.rates)} rates x {args.rounds} rounds; "
              f"cache {args.cache}", flush=True)
        start = time.time()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
        try:
            run_grid(args, selection, works)
        except KeyboardInterrupt:
            print(f"interrupted: the finished cells are in {args.cache}; the same command resumes", flush=True)
            return 130
        print(f"grid done in {time.time() - start:.0f} s", flush=True)
    data = report(args, selection)
    raw = raw_dir(args.out_dir)
    for folder in (args.out_dir, raw):
        folder.mkdir(parents=True, exist_ok=True)
    (raw / "scaling.json").write_text(json.dumps(data, indent=1))
    plot(data, raw / "scaling.png")
    write_markdown(data, args.out_dir / "scaling.md", raw / "scaling.png")
    print_table(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
