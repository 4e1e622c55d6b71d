"""Does the default find the win: ``shard_group_size="auto"`` against the layouts it chooses from, on
the two-node testbed.

One sitting: 3 interleaved rounds at 1 Gbit/s between the two namespaces (``cluster.py``), interval
8, overlapped bf16, 16 timed steps a cell (``TIMED_STEPS``), on ``scaling.py``'s Criteo-like, pooled
and skewed workloads (SYNTHETIC ids; the skewed model plans with 1.75 GiB a rank, where only 1D and
per-table layouts fit). Every cell is a
fresh set-up in every round. The cells:

* ``twod 1x4``: 1D;
* on Criteo-like and pooled, each global layout that fits: 2x2 contiguous and 4x1 (every table on
  every rank);
* on the skewed model, the per-table layout the method intends, pinned (the large table in a group
  of 4, the others in groups of 2);
* ``auto`` on the links ``lightning-twod calibrate`` measured on the testbed (``calibration.py``
  keeps them): what auto picks when it knows the links;
* ``auto`` as a user gets it: no links given, so the strategy's default (``links="auto"``): the
  first set-up of the sitting measures the links and keeps them in the links cache, which lives in
  ``WORK_DIR/links_cache`` (``scaling.py``'s; a fresh work dir starts with none); the later
  set-ups, of every workload, read them there.

Prints, and writes to ``OUT/auto.md``, every cell's ms per step in each round, what each auto cell
chose in each round, and per round auto against the fastest other cell (auto on calibrated links
included), against the other cells that ran the layout auto chose, and against the fastest cell of
another layout (target: auto within 10 % of the best layout, a ratio of at least 0.90, in every
round; two set-ups of one layout land more than 10 % apart on 2 shared cores, so a cell of auto's
own layout measures the set-up, not the choice). ``OUT/phases.md``: each cell's measured phases beside the
planner's prediction on the calibrated links (``predicted_phases.py``).

    python benchmarks/auto.py              # OUT = benchmarks/results/auto
    python benchmarks/auto.py --quick      # tiny tables: checks the harness
    python benchmarks/auto.py --workloads skewed-bare   # the skewed tables, nothing before the lookup
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import overlap  # noqa: E402
import per_table  # noqa: E402
import predicted_phases  # noqa: E402

WORKLOADS = ("criteo", "pooled", "skewed")
#: also run on request: the skewed tables with the bare model (nothing before the lookup)
EXTRA_WORKLOADS = ("skewed-bare",)
TARGET = 0.90
#: Steps each cell times: 2 rounds of interval 8, so the sitting fits in about 20 minutes. Timing 4 rounds
#: (the third sitting) did not narrow how far two set-ups of one layout land apart on 2 cores (pooled 1D
#: in one round: 135 and 170 ms a step), and made the sitting 30 minutes.
TIMED_STEPS = 16


def cells_of(workload: str, quick: bool) -> dict[str, str]:
    """The cells run on ``workload``: key -> ``scaling.grid`` name; ``auto`` and ``calibrated`` are auto's."""
    k = 2 if quick else 8
    cells = {"1d": "twod 1x4"}
    if workload.startswith("skewed"):
        cells["pinned"] = f"twod per-table pinned k{k} overlap bf16"
    else:
        cells |= {"2x2": f"twod 2x2c k{k} overlap bf16", "4x1": f"twod 4x1 k{k} overlap bf16"}
    return cells | {"calibrated": f"twod per-table auto k{k} overlap bf16 calibrated",
                    "auto": f"twod per-table auto k{k} overlap bf16"}


def per_round(result: dict, cell: str) -> dict[int, dict]:
    """Round -> that round's row of ``cell`` (ms per step, the group sizes its ranks recorded)."""
    return {r["round"]: r for r in result["rounds"].get(cell, []) if "step_ms" in r}


def layout_of(row: dict) -> tuple:
    """The layout a cell ran: every table's group size (placement is contiguous in every cell)."""
    return tuple(sorted((row.get("group_sizes") or {}).items()))


def auto_rows(result: dict, cells: dict[str, str]) -> list[str]:
    """Per round: each auto cell's ms per step against the best other cell (best / auto), against the
    other cells that ran its layout, and against the best cell of another layout, which the target
    judges (auto within 10 % of the best layout: two set-ups of one layout land apart by more than
    that on 2 shared cores, so a cell of auto's own layout does not judge auto's choice)."""
    rows = {key: per_round(result, name) for key, name in cells.items()}
    lines = ["| auto cell | round | ms/step | best other cell (ms/step) | best / auto | its layout elsewhere (ms/step) "
             "| best other layout (ms/step) | that / auto | target |", "|---|---:|---:|---|---:|---|---|---:|---|"]
    for key in ("auto", "calibrated"):
        others = [o for o in cells if o not in (key, "auto")]  # auto on calibrated links is one of auto's candidates
        for r in sorted(rows[key]):
            measured = {o: rows[o][r] for o in others if r in rows[o]}
            if not measured:
                continue
            mine, step = layout_of(rows[key][r]), rows[key][r]["step_ms"]
            best = min(measured, key=lambda o: measured[o]["step_ms"])
            same = [f"{measured[o]['step_ms']:,.0f}" for o in measured if layout_of(measured[o]) == mine]
            other = [o for o in measured if layout_of(measured[o]) != mine]
            line = (f"| `{cells[key]}` | {r} | {step:,.0f} | `{cells[best]}` ({measured[best]['step_ms']:,.0f}) | "
                    f"{measured[best]['step_ms'] / step:.2f} | {', '.join(same) or '-'} | ")
            if other:
                rival = min(other, key=lambda o: measured[o]["step_ms"])
                ratio = measured[rival]["step_ms"] / step
                verdict = "met" if ratio >= TARGET else "**missed**"
                line += f"`{cells[rival]}` ({measured[rival]['step_ms']:,.0f}) | {ratio:.2f} | {TARGET:.2f} {verdict} |"
            else:
                line += "- | - | no other layout |"
            lines.append(line)
    return lines


def write_report(data: dict, path: Path, quick: bool) -> str:
    lines = ["# Does the default find the win? (`benchmarks/auto.py`)", "",
             "Interval 8, overlapped bf16, every cell a fresh set-up in every round. `per-table auto` is the "
             "strategy's default, `shard_group_size=\"auto\"` (global and per-table layouts); `calibrated`: the same "
             "on the links `lightning-twod calibrate` measured on the testbed.", ""]
    for workload, rates in data["results"].items():
        cells = cells_of(workload, quick)
        for rate, result in rates.items():
            lines += [f"## {workload}, {rate}", ""]
            lines += overlap.ratio_and_step_tables(result, cells, [])[3:]  # the ms per step of every cell
            lines += ["", *auto_rows(result, cells), "", "What auto chose:", ""]
            lines += [f"* `{cells[key]}`: {per_table.chosen_sizes(result, cells[key])}" for key in ("auto", "calibrated")]
            lines += ["", "Where the step goes (ms per step, the cell's median round; `throughput.breakdown`):", ""]
            lines += overlap.phase_table(result["summary"], cells)
            lines.append("")
    lines += ["The planner's prediction of each phase beside the measured one: [`phases.md`](phases.md).", ""]
    return overlap.write_page(lines, data, path)


def write_phases(work_dir: Path, links, path: Path) -> None:
    """``predicted_phases.report`` of the sitting's runs (``WORK_DIR/runs.jsonl``) on ``links``, to ``path``."""
    runs = (work_dir / "runs.jsonl").read_text().splitlines()
    path.write_text(predicted_phases.report([json.loads(line) for line in runs if line.strip()], links))


def main(argv: list[str] | None = None) -> int:
    parser = overlap.sitting_parser(__doc__, "auto")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS + EXTRA_WORKLOADS, default=list(WORKLOADS))
    args = parser.parse_args(argv)
    links = per_table.testbed_links(args.rate)  # the calibrated cells' links: measured first when missing
    sittings: list[dict] = []  # scaling.py's data of each workload (each has its own cells)

    def keep(data: dict, _path: Path, cells: dict[str, str]) -> str:
        sittings.append(data)
        return f"{', '.join(data['results'])}: {len(cells)} cells"

    for workload in args.workloads:
        if overlap.run_and_report(args, cells_of(workload, args.quick), [workload], keep, "auto.md",
                                  timed_steps=0 if args.quick else TIMED_STEPS) != 0:
            return 1
    data = {**sittings[-1], "results": {k: v for d in sittings for k, v in d["results"].items()}}
    print(write_report(data, args.out_dir / "auto.md", args.quick))
    write_phases(args.work_dir, links, args.out_dir / "phases.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
