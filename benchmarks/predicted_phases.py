"""The planner's predicted step, phase by phase, next to the measured one, for the ``twod`` cells of a
run of ``scaling.py`` (or of ``overlap.py`` / ``per_table.py``, which run its cells).

For every cell of the runs (``runs.jsonl`` in each run's work dir), the median over ranks of each
measured phase (``throughput.breakdown``, ms per step), the median over rounds, beside
``steptime.step_time`` for the same layout (the group sizes the cell's ranks recorded: per-table
cells too), interval, overlap, wire and workload, on the links of a ``calibrate`` file (the lookup
statistics are the workload's: ids a bag and skew, as the batches were drawn; the dense part from
the DLRM's parameters by the 6 N rule, as the strategy assumes at set-up). Phases, measured ->
predicted:

* ``lookup``: lookup, lookup backward and the sparse update outside the round -> ``lookup``;
* ``in a2a``: input check and input dist -> ``input_all_to_all``; ``out a2a``: output dist
  forward and backward -> ``output_all_to_all``;
* ``x-group``: the round's parts on the training thread (``cross_group``) -> ``reduction``;
* ``dense AR``: what the step waited for DDP's all-reduce after the backward's own work (from its
  last autograd node to its last bucket reduced; ``workload.timed_allreduce_hook``) ->
  ``dense_all_reduce`` + ``dense_wait``, what the model says the compute does not hide (records
  made before that wait was timed give the span from the first bucket to the last instead);
* ``rest``: forward, backward and optimizer rest and the loop -> ``dense_compute``;

per round (median over ranks): agreeing on the rows, packing and applying, and waiting for the
sums, next to the predicted passes (``round_traffic``) and transfer (``round_transfer``); and what
the step waits for DDP's all-reduce after the backward's own work, on the median rank and on the
rank whose backward ended last (``workload.last_rank_wait``: what the all-reduce itself costs;
the other ranks wait for that rank too, whose step is as long as theirs), next to the predicted
``dense_all_reduce`` + ``dense_wait``. Reads
records only: it runs nothing, so it needs no lock and takes seconds::

    python benchmarks/predicted_phases.py --runs build/overlap/runs.jsonl \\
        --links build/calibration/links_1gbit.yaml [--out phases.md]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import calibration  # noqa: E402
import throughput  # noqa: E402
import workload as W  # noqa: E402

from lightning_twod.planner import LinkModel, StepTime, TableSpec  # noqa: E402
from lightning_twod.planner.layout import evaluate_layout  # noqa: E402

#: measured phase -> the ``throughput.breakdown`` parts it sums (ms per step)
MEASURED = {"lookup": ("lookup", "lookup_backward", "sparse_update"), "in a2a": ("input_check", "input_dist"),
            "out a2a": ("output_dist", "output_dist_backward"), "x-group": ("cross_group",),
            "dense AR": ("dense_allreduce",), "rest": ("forward_rest", "backward_rest", "optimizer_rest", "other")}
#: measured phase -> the ``StepTime`` phases it is set against
PREDICTED = {"lookup": ("lookup",), "in a2a": ("input_all_to_all",), "out a2a": ("output_all_to_all",),
             "x-group": ("reduction",), "dense AR": ("dense_all_reduce", "dense_wait"), "rest": ("dense_compute",)}
ROUND_PARTS = {"agree": ("part_agree_rows",), "pack + apply": ("part_pack", "part_apply"), "wait": ("part_wait",)}


def specs_of(work: W.Workload) -> dict[str, list[TableSpec]]:
    """The benchmark DLRM's tables (the first of ``big_rows`` where set) with the batches' statistics."""
    ids = (work.min_ids + work.max_ids) / 2
    return {"sparse": [TableSpec(f"t_cat_{i}", rows, work.dim, pooling_factor=ids, id_skew=work.skew)
                       for i, rows in enumerate(work.table_rows)]}


def measured_phases(rank: dict) -> dict[str, float]:
    """One rank's ms per step by phase (``MEASURED``); the sparse update less the round in it."""
    parts = throughput.breakdown(rank)
    parts["sparse_update"] = max(0.0, parts["sparse_update"] - parts["cross_group"])
    return {phase: sum(parts[k] for k in keys) for phase, keys in MEASURED.items()} | {"step": rank["step_ms"]}


def measured_round(rank: dict) -> dict[str, float] | None:
    """One rank's ms per round by part (``ROUND_PARTS``); None without a round."""
    counters = rank.get("counters", {})
    rounds = counters.get("rounds", 0)
    if not rounds:
        return None
    return {part: 1e3 * sum(counters.get(k, 0.0) for k in keys) / rounds for part, keys in ROUND_PARTS.items()}


def predict(record: dict, links: LinkModel) -> StepTime | None:
    """The planner's step for the cell of ``record`` (None where the layout does not plan)."""
    cell, work = record["cell"], calibration.workload_of(record)
    sizes = record["ranks"][0].get("group_sizes") or {}
    size = Counter(sizes.values()).most_common(1)[0][0] if sizes else cell["shard"]
    candidate = evaluate_layout(specs_of(work), work.world, size, cell["placement"], calibration.RANKS_PER_NODE,
                                math.inf, calibration.workload_for(cell, work), links, calibration.dense_of(work),
                                own_sizes=sizes)
    return candidate.time if candidate.fits else None


def _median(rows: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def report(records: list[dict], links: LinkModel) -> str:
    """One table of phases (measured / predicted ms per step) and one of round parts, per workload."""
    by_cell: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        if record["cell"].get("family") == "twod" and record.get("ranks"):
            by_cell.setdefault((record["workload"], record["cell"]["name"]), []).append(record)
    lines = [f"Measured / predicted ms per step (links {links.name}: {links.source})", "",
             "| workload | cell | step | " + " | ".join(MEASURED) + " |", "|---|---|" + "---:|" * (len(MEASURED) + 1)]
    rounds = ["", "Per round (ms, median rank): measured agree, pack + apply, wait / predicted passes, transfer", "",
              "| workload | cell | agree | pack + apply | wait | passes | transfer |", "|---|---|---:|---:|---:|---:|---:|"]
    waits: list[str] = []  # rows only for records with the ranks' marks
    for (name, cell), recs in sorted(by_cell.items()):
        time = predict(recs[0], links)
        measured = _median([_median([measured_phases(r) for r in rec["ranks"]]) for rec in recs])
        if time is None:
            lines.append(f"| {name} | `{cell}` | {measured['step']:.0f} / no fit |" + " |" * len(MEASURED))
            continue
        predicted = {p: 1e3 * sum(getattr(time, f) for f in fields) for p, fields in PREDICTED.items()}
        lines.append(f"| {name} | `{cell}` | {measured['step']:.0f} / {time.total * 1e3:.0f} | "
                     + " | ".join(f"{measured[p]:.0f} / {predicted[p]:.0f}" for p in MEASURED) + " |")
        parts = [p for rec in recs for p in map(measured_round, rec["ranks"]) if p]
        if parts:
            part = _median(parts)
            rounds.append(f"| {name} | `{cell}` | {part['agree']:.0f} | {part['pack + apply']:.0f} | "
                          f"{part['wait']:.0f} | {time.round_traffic * 1e3:.0f} | {time.round_transfer * 1e3:.0f} |")
        last = [w for w in (W.last_rank_wait([r.get("dense_marks") or [] for r in rec["ranks"]]) for rec in recs)
                if w is not None]
        if last:
            waits.append(f"| {name} | `{cell}` | {measured['dense AR']:.1f} | {statistics.median(last):.1f} | "
                         f"{(time.dense_all_reduce + time.dense_wait) * 1e3:.1f} |")
    if waits:
        waits = ["", "DDP's all-reduce, ms per step the step waits for it after the backward's own work (the median "
                 "over rounds): measured on the median rank and on the rank whose backward ended last, and predicted",
                 "", "| workload | cell | median rank | last rank | predicted |", "|---|---|---:|---:|---:|", *waits]
    return "\n".join(lines + rounds + waits) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="scaling.py caches (runs.jsonl)")
    parser.add_argument("--links", type=Path, required=True, help="a links file written by `calibrate`")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = parser.parse_args(argv)
    records = [json.loads(line) for path in args.runs for line in path.read_text().splitlines() if line.strip()]
    text = report(records, LinkModel.load(args.links))
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
