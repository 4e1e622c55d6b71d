"""Criteo reading at W ranks: delivered samples/s and bytes read per rank, the TSV reader against the
prepared format, with and without DataLoader workers (no training).

    python benchmarks/data.py                       # 2 M lines, W = 1, 2, 4, 8, workers 0 and 2
    python benchmarks/data.py --lines 20000 --worlds 1,2 --workers 0 --out /tmp/data   # a quick look

The data are SYNTHETIC: a Criteo-format TSV file (label, 13 integer and 26 hexadecimal columns, some
empty, heavy-tailed values) generated from a seed into ``build/data_bench/`` (git ignores it), then
prepared once (``prepare_criteo``; its time is reported too). Each cell starts W reader processes
(rank r of W, as ``CriteoDataModule``'s training loader builds them: the last incomplete global
batch dropped, the prepared row groups shuffled) that wait at a barrier and then read one whole
epoch. A rank's samples/s is its real samples over its own wall time; its bytes read are the
``rchar`` of ``/proc/<pid>/io`` (bytes that ``read`` returned, page cache included) over the pass,
of the rank's process, or of its DataLoader workers where it has them (the rank's own ``read`` calls
then receive the batches from its workers). Targets: bytes per rank within 1.2x of the
prepared data's total / W at every W; a rank at W = 4 delivers at least 5x the TSV reader's samples/s.

Writes ``OUT/data.md`` (the table, the targets, the load average) and ``OUT/data.json``
(default ``benchmarks/results/data/``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from torch.utils.data import IterableDataset

ROOT = Path(__file__).resolve().parents[1]
TABLE_ROWS = 100_000
VOCABULARY = [int(v) for v in np.geomspace(10, 10_000_000, 26)]  # distinct values per categorical column
EMPTY = 0xFF  # a byte no field holds: removed after the fields are laid out


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


# ----------------------------------------------------------------------------- the synthetic file
def _digits(values: np.ndarray, width: int, base: int, alphabet: bytes, keep_zeros: bool) -> np.ndarray:
    """``values`` [n] (non-negative, below ``base ** width``) as ``width`` characters [n, width];
    leading zeros are ``EMPTY`` unless ``keep_zeros``."""
    out = np.empty((len(values), width), np.uint8)
    rest = values.astype(np.int64)
    for k in range(width - 1, -1, -1):
        out[:, k] = np.frombuffer(alphabet, np.uint8)[rest % base]
        rest //= base
    if not keep_zeros:
        length = 1 + sum((values >= base**k).astype(np.int64) for k in range(1, width))  # digits of each value
        out[np.arange(width)[None, :] < (width - length)[:, None]] = EMPTY
    return out


def synthetic_lines(n: int, rng: np.random.Generator) -> bytes:
    """``n`` SYNTHETIC lines in Criteo's format (values drawn, not Criteo's)."""
    fields = [np.where(rng.random(n) < 0.26, ord("1"), ord("0")).astype(np.uint8)[:, None]]
    for _ in range(13):
        value = np.minimum(rng.pareto(1.2, n) * 3, 999_999).astype(np.int64)
        negative = rng.random(n) < 0.02
        text = np.concatenate([np.full((n, 1), EMPTY, np.uint8), _digits(value, 6, 10, b"0123456789", False)], 1)
        text[negative, 0], text[negative, 1:6] = ord("-"), EMPTY
        text[negative, 6] = rng.integers(ord("1"), ord("4"), int(negative.sum()))
        text[rng.random(n) < 0.2] = EMPTY
        fields.append(text)
    for vocabulary in VOCABULARY:
        ids = (rng.pareto(1.1, n) * vocabulary / 50).astype(np.int64) % vocabulary
        hashed = (ids * 2_654_435_761 + vocabulary) % 2**32  # a fixed scramble: 8 hexadecimal digits
        text = _digits(hashed, 8, 16, b"0123456789abcdef", True)
        text[rng.random(n) < 0.1] = EMPTY
        fields.append(text)
    tab = np.full((n, 1), ord("\t"), np.uint8)
    parts = [fields[0]] + [p for f in fields[1:] for p in (tab, f)] + [np.full((n, 1), ord("\n"), np.uint8)]
    laid = np.concatenate(parts, axis=1).ravel()
    return laid[laid != EMPTY].tobytes()


def write_synthetic(path: Path, lines: int, seed: int = 0, chunk: int = 200_000) -> None:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        for start in range(0, lines, chunk):
            out.write(synthetic_lines(min(chunk, lines - start), rng))


# ----------------------------------------------------------------------------- one rank
class Measured(IterableDataset):
    """ ``inner``'s batches, then ``{"rchar": bytes this process read during the pass}``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __iter__(self):
        before = rchar()
        yield from self.inner
        yield {"rchar": rchar() - before}


def _rank(rank: int, world: int, fmt: str, path: str, workers: int, batch: int, barrier, results) -> None:
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    from lightning_twod.datasets.criteo import CriteoTSV
    from lightning_twod.datasets.criteo_prepared import CriteoPrepared

    rows = [TABLE_ROWS] * 26
    if fmt == "tsv":
        data = CriteoTSV(path, rows, batch, drop_last=True, rank=rank, world_size=world)
    else:
        data = CriteoPrepared(path, rows, batch, drop_last=True, rank=rank, world_size=world, shuffle=True)
    # workers forked from the rank, as under torchrun or Lightning (a spawned rank would spawn its workers too)
    loader = DataLoader(Measured(data), batch_size=None, num_workers=workers,
                        multiprocessing_context="fork" if workers else None)
    barrier.wait()
    began, before = time.perf_counter(), rchar()
    samples, read, batches = 0, 0, 0
    for item in loader:
        if "rchar" in item:  # a worker's reads (this process's own are batches passed on by the workers)
            read += item["rchar"]
            continue
        samples += int((item["index"] >= 0).sum())
        batches += 1
    seconds = time.perf_counter() - began
    results.put({"rank": rank, "samples": samples, "batches": batches, "seconds": seconds,
                 "bytes": read if workers else rchar() - before})


def run_cell(fmt: str, path: Path, world: int, workers: int, batch: int) -> dict:
    """W reader processes at once; per-rank samples/s and bytes, and the load average after."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, fmt, str(path), workers, batch, barrier, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = []
    while len(got) < world:
        try:
            got.append(results.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{fmt} W={world} workers={workers}: a reader failed (its traceback is above)") from None
    ranks = sorted(got, key=lambda r: r["rank"])
    for p in procs:
        p.join()
    if len({r["batches"] for r in ranks}) != 1:
        raise RuntimeError(f"{fmt} W={world}: ranks ran different numbers of batches: {ranks}")
    rates = [r["samples"] / r["seconds"] for r in ranks]
    return {"format": fmt, "world": world, "workers": workers, "batches": ranks[0]["batches"],
            "samples_per_s": float(np.mean(rates)), "slowest_samples_per_s": min(rates),
            "bytes_per_rank": float(np.mean([r["bytes"] for r in ranks])),
            "max_bytes_per_rank": max(r["bytes"] for r in ranks), "loadavg_after": loadavg()}


# ----------------------------------------------------------------------------- the report
def judge(cells: list[dict], total: dict[str, int]) -> dict:
    """The targets: prepared bytes per rank / (total / W) at every W and workers, and the prepared
    over the TSV samples/s at W = 4 (each number of workers)."""
    bytes_ratio = {f"W={c['world']} workers={c['workers']}": c["max_bytes_per_rank"] / (total["prepared"] / c["world"])
                   for c in cells if c["format"] == "prepared"}
    by = {(c["format"], c["world"], c["workers"]): c for c in cells}
    speedup = {f"workers={k}": by["prepared", 4, k]["samples_per_s"] / by["tsv", 4, k]["samples_per_s"]
               for (f, w, k) in by if f == "tsv" and w == 4 and ("prepared", 4, k) in by}
    return {"bytes_ratio": bytes_ratio, "bytes_within_1.2x": all(r <= 1.2 for r in bytes_ratio.values()),
            "speedup_at_4": speedup, "speedup_at_4_at_least_5x": bool(speedup) and min(speedup.values()) >= 5}


def markdown(meta: dict, cells: list[dict], verdict: dict) -> str:
    total = meta["bytes"]
    rows = ["| format | W | workers | samples/s per rank (mean / slowest) | MB read per rank (max) | "
            "x total/W | batches per rank | load after |", "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        share = c["max_bytes_per_rank"] / (total[c["format"]] / c["world"])
        rows.append(f"| {c['format']} | {c['world']} | {c['workers']} | {c['samples_per_s']:,.0f} / "
                    f"{c['slowest_samples_per_s']:,.0f} | {c['max_bytes_per_rank'] / 1e6:,.1f} | {share:.2f} | "
                    f"{c['batches']} | {c['loadavg_after']} |")
    ratios = ", ".join(f"{k}: {v:.2f}" for k, v in verdict["bytes_ratio"].items())
    speedups = ", ".join(f"{k}: {v:.1f}x" for k, v in verdict["speedup_at_4"].items())
    return "\n".join([
        "# Criteo reading: samples/s and bytes per rank, TSV against the prepared format",
        "",
        f"`python benchmarks/data.py {meta['args']}`, {meta['date']}, commit {meta['commit']}, on {meta['machine']}; "
        f"pyarrow {meta['pyarrow']}. Data: SYNTHETIC, {meta['lines']:,} lines in Criteo's format "
        f"({total['tsv'] / 1e6:,.0f} MB of TSV; prepared: {total['prepared'] / 1e6:,.1f} MB of Parquet in row "
        f"groups of {meta['row_group_size']:,} rows, written in {meta['prepare_s']:.1f} s, "
        f"{meta['lines'] / meta['prepare_s']:,.0f} lines/s). {meta['batch']:,} samples per rank and batch, the "
        "training loader (last incomplete global batch dropped; prepared row groups shuffled). W reader "
        "processes at once on this machine's cores, no training; bytes: `rchar` over the pass of the rank's "
        f"process, or of its DataLoader workers where it has them. Load average before: {meta['loadavg_before']}, after: "
        f"{meta['loadavg_after']} (the readers' own processes count).",
        "",
        *rows,
        "",
        f"* Bytes per rank within 1.2x of the prepared total / W at every W: **{verdict['bytes_within_1.2x']}** "
        f"({ratios}). The TSV reader reads the whole file on every rank (x W).",
        f"* Prepared over TSV samples/s per rank at W = 4: **{speedups}** (target: at least 5x: "
        f"**{verdict['speedup_at_4_at_least_5x']}**).",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--worlds", default="1,2,4,8")
    parser.add_argument("--workers", default="0,2", help="DataLoader workers per rank, comma-separated")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--row-group-size", type=int, default=8192)
    parser.add_argument("--build", default=str(ROOT / "build" / "data_bench"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data"))
    args = parser.parse_args()
    import pyarrow

    from lightning_twod.datasets.criteo_prepare import prepare_criteo

    build = Path(args.build)
    tsv, prepared = build / f"synthetic_criteo_{args.lines}.tsv", build / f"prepared_{args.lines}_{args.row_group_size}"
    if not tsv.is_file():
        began = time.perf_counter()
        write_synthetic(tsv, args.lines)
        print(f"wrote {args.lines:,} SYNTHETIC lines to {tsv} in {time.perf_counter() - began:.1f} s", flush=True)
    shutil.rmtree(prepared, ignore_errors=True)
    began = time.perf_counter()
    prepare_criteo(tsv, prepared, TABLE_ROWS, row_group_size=args.row_group_size)
    prepare_s = time.perf_counter() - began
    total = {"tsv": tsv.stat().st_size, "prepared": sum(f.stat().st_size for f in prepared.glob("*.parquet"))}
    print(f"prepared in {prepare_s:.1f} s: {total['prepared'] / 1e6:.1f} MB", flush=True)
    before, cells = loadavg(), []
    for world in (int(w) for w in args.worlds.split(",")):
        for workers in (int(k) for k in args.workers.split(",")):
            for fmt in ("tsv", "prepared"):
                cell = run_cell(fmt, tsv if fmt == "tsv" else prepared, world, workers, args.batch)
                cells.append(cell)
                print(f"{fmt:>8} W={world} workers={workers}: {cell['samples_per_s']:>11,.0f} samples/s per rank, "
                      f"{cell['max_bytes_per_rank'] / 1e6:>8,.1f} MB per rank (load {cell['loadavg_after']})",
                      flush=True)
    commit = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
    meta = {"args": " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                             if k not in ("build", "out")),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "machine": f"{os.cpu_count()} cores", "pyarrow": pyarrow.__version__, "lines": args.lines,
            "bytes": total, "row_group_size": args.row_group_size, "prepare_s": prepare_s, "batch": args.batch,
            "loadavg_before": before, "loadavg_after": loadavg()}
    verdict = judge(cells, total)
    report = markdown(meta, cells, verdict)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.md").write_text(report)
    (out / "data.json").write_text(json.dumps({"meta": meta, "cells": cells, "verdict": verdict}, indent=1) + "\n")
    print("\n" + report)


if __name__ == "__main__":
    main()
