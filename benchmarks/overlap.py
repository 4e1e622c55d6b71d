"""The headline of the two-node testbed: twod 1D against TorchRec DMP 1D, the best 2D against its bound.

One sitting (about 20 minutes on 2 cores): 3 interleaved rounds, at 1 Gbit/s between the two
namespaces (``cluster.py``), Criteo-like and pooled (``scaling.py``'s workloads), of five cells of
``scaling.py``'s grid each: ``twod 1x4``, ``torchrec dmp 1d``, the 2x2 contiguous overlapped bf16
layout at intervals 8 and 32, and ``bound 2x2c no reduction`` (the same layout with no round in the
timed window: what a reduction that cost nothing would give). ``--workloads criteo-bare pooled-bare``
adds the same tables with the bare model (nothing before the lookup: ``scaling.py``); ``--cells 1d
torchrec`` runs only the named cells of the five (the ratios between them), ``--page`` names the page.
Prints, and writes to ``OUT/overlap.md``, the ratios of each round (throughput: the baseline's ms per step over the
cell's), their median, the load average of each round, every cell's steps, and where the time
of each cell goes; ``OUT/scaling.md`` and ``scaling.json`` hold everything ``scaling.py`` reports
(``scaling.json`` and ``scaling.png`` in the twin of ``OUT`` under ``benchmarks/out``, git-ignored:
``outputs.py``).

    bash benchmarks/setup_torchrec.sh      # once: TorchRec's own environment
    python benchmarks/overlap.py           # OUT = benchmarks/results/overlap
    python benchmarks/overlap.py --cells 1d torchrec --workloads criteo pooled criteo-bare pooled-bare \
        --out-dir benchmarks/results/overlap/bare --work-dir build/overlap-bare --page bare.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import scaling  # noqa: E402
import throughput  # noqa: E402

from benchmarks.outputs import raw_dir  # noqa: E402

CELLS = {"1d": "twod 1x4", "torchrec": "torchrec dmp 1d", "k8": "twod 2x2c k8 overlap bf16",
         "k32": "twod 2x2c k32 overlap bf16", "bound": "bound 2x2c no reduction"}
QUICK_CELLS = {**CELLS, "k8": "twod 2x2c k2 overlap bf16", "k32": "twod 2x2c k2 overlap fp32"}  # the quick grid's
# (the cell, its baseline, target): a ratio is the baseline's ms per step over the cell's
RATIOS = [("1d", "torchrec", 1.0), ("k8", "bound", 0.90), ("k32", "bound", None), ("k8", "1d", 1.2),
          ("k8", "torchrec", None)]
ROUND_PARTS = [("part_agree_rows", "agreeing on the touched rows"), ("part_pack", "packing the wire buffer"),
               ("part_wait", "waiting for the sums"), ("part_apply", "applying them")]
PHASES = ["input_check", "input_dist", "lookup", "output_dist", "forward_rest", "output_dist_backward",
          "lookup_backward", "dense_allreduce", "backward_rest", "sparse_update", "cross_group", "optimizer_rest",
          "other"]


def ratio_rows(result: dict, cells: dict[str, str], ratios: list[tuple] = RATIOS) -> list[dict]:
    """Per ratio (``(cell, baseline, target)``): the per-round values (None where a round of either cell
    is missing) and their median."""
    def per_round(name: str) -> dict[int, float]:
        return {r["round"]: r["step_ms"] for r in result["rounds"].get(name, []) if "step_ms" in r}

    rows = []
    for cell, base, target in ratios:
        what = f"`{cells[cell]}` / `{cells[base]}`"
        ours, theirs = per_round(cells[cell]), per_round(cells[base])
        rounds = [theirs[r] / ours[r] if r in ours and r in theirs else None for r in sorted({*ours, *theirs})]
        measured = [r for r in rounds if r is not None]
        median = statistics.median(measured) if measured else None
        verdict = "" if target is None or median is None else ("met" if median >= target else "**missed**")
        rows.append({"what": what, "rounds": rounds, "median": median, "target": target, "verdict": verdict})
    return rows


def sitting_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The options of a one-sitting benchmark named ``name``: rounds, rate, its folders, quick, report only."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results" / name)
    parser.add_argument("--work-dir", type=Path, default=HERE.parent / "build" / name)
    parser.add_argument("--quick", action="store_true", help="tiny tables, few steps: checks the harness")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the outputs from the cache")
    return parser


def run_and_report(args, cells: dict[str, str], workloads: list[str], report, page: str,
                   timed_steps: int = 0) -> int:
    """``cells`` through ``scaling.py`` (what its cache lacks) with ``args``' rounds, rate and folders, and
    at least ``timed_steps`` timed steps a cell, then ``report(scaling.json's data, OUT/page, cells)``
    printed; the exit code."""
    forwarded = ["--rounds", str(args.rounds), "--rates", args.rate, "--workloads", *workloads,
                 "--timed-steps", str(timed_steps),
                 "--cells", *[f"^{name}$" for name in cells.values()], "--out-dir", str(args.out_dir),
                 "--work-dir", str(args.work_dir), *(["--quick"] if args.quick else []),
                 *(["--report-only"] if args.report_only else [])]
    if scaling.main(forwarded) != 0:
        return 1
    data = json.loads((raw_dir(args.out_dir) / "scaling.json").read_text())
    print(report(data, args.out_dir / page, cells))
    return 0


def write_page(lines: list[str], data: dict, path: Path) -> str:
    """``lines`` and the load average of each round of ``data`` written to ``path``; the text."""
    loads = {m["round"]: f"{m['loadavg_before']} -> {m['loadavg_after']}" for m in data.get("rounds_meta", [])}
    lines = [*lines, "Load average (1, 5, 15 min) before -> after each round, the runs' own ranks included:", "",
             *[f"* round {r}: {loads[r]}" for r in sorted(loads)]]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def ratio_and_step_tables(result: dict, cells: dict[str, str], ratios: list[tuple] = RATIOS) -> list[str]:
    """The ratios of each round with their median and target (those between cells of ``cells``), then each
    cell's ms per step, as markdown rows."""
    lines = ["| ratio | median | rounds | target |", "|---|---:|---|---|"]
    ratios = [r for r in ratios if r[0] in cells and r[1] in cells]
    for row in ratio_rows(result, cells, ratios):
        rounds = ", ".join("-" if r is None else f"{r:.2f}" for r in row["rounds"])
        median = "-" if row["median"] is None else f"**{row['median']:.2f}x**"
        target = "" if row["target"] is None else f"{row['target']:.2f}x {row['verdict']}"
        lines.append(f"| {row['what']} | {median} | {rounds} | {target} |")
    lines += ["", "| cell | ms/step (median) | per round |", "|---|---:|---|"]
    for cell in cells.values():
        row = result["summary"].get(cell)
        if row:
            each = ", ".join(f"{v:,.0f}" for v in row["step_ms_rounds"])
            lines.append(f"| `{cell}` | {row['step_ms']:,.0f} | {each} |")
    return lines


def phase_table(summary: dict, cells: dict[str, str]) -> list[str]:
    """Where each cell's step goes (ms, median round), as markdown rows."""
    names = [scaling.NAMES[p] for p in PHASES]
    lines = ["| cell | ms/step | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for cell in cells.values():
        row = summary.get(cell)
        if not row:
            continue
        parts = throughput.breakdown(row)
        lines.append(f"| `{cell}` | {row['step_ms']:,.0f} | " + " | ".join(f"{parts.get(p, 0.0):.0f}" for p in PHASES) + " |")
    return lines


def round_memory(row: dict) -> str:
    """What the cell's rounds hold besides the tables (references, buffers), per replicated element."""
    held = row.get("round_bytes_per_element")
    return "" if held is None else f"; the round holds {held:.1f} bytes an element of the replicated shards"


def write_report(data: dict, path: Path, cells: dict[str, str] = CELLS) -> str:
    lines = ["# The two-node testbed headline (`benchmarks/overlap.py`)", "",
             "Ratios are throughput ratios: the baseline's ms per step over the cell's (above 1: the cell is faster).", ""]
    for workload, rates in data["results"].items():
        for rate, result in rates.items():
            summary = result["summary"]
            lines += [f"## {workload}, {rate}", ""] + ratio_and_step_tables(result, cells)
            lines += ["", "Where the step goes (ms per step, the cell's median round; `throughput.breakdown`):", ""]
            lines += phase_table(summary, cells)
            for key in ("k8", "k32"):
                row = summary.get(cells.get(key), {})
                for unit in ("step", "round"):
                    parts = row.get(f"reduction_parts_ms_per_{unit}")
                    if parts:
                        lines.append(f"\nThe round in `{cells[key]}`, ms per {unit} (slowest rank): launching "
                                     f"{parts.get('launch', 0):.1f}, waiting and applying {parts.get('wait_and_apply', 0):.1f}; "
                                     "by part: " + ", ".join(f"{label} {parts.get(name, 0):.1f}" for name, label in ROUND_PARTS)
                                     + (round_memory(row) if unit == "round" else ""))
            lines.append("")
    return write_page(lines, data, path)


def main(argv: list[str] | None = None) -> int:
    parser = sitting_parser(__doc__, "overlap")
    parser.add_argument("--workloads", nargs="+", choices=list(scaling.WORKLOADS), default=list(scaling.DEFAULT_WORKLOADS))
    parser.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS),
                        help="only these of the five cells (default: all)")
    parser.add_argument("--page", default="overlap.md", help="the page's name in OUT")
    args = parser.parse_args(argv)
    cells = QUICK_CELLS if args.quick else CELLS  # the quick grid has interval 2 only
    cells = {key: name for key, name in cells.items() if key in args.cells}
    return run_and_report(args, cells, args.workloads, write_report, args.page)


if __name__ == "__main__":
    sys.exit(main())
