"""Per-table group sizes on the two-node testbed: a skewed model, the planner's choice per table
against the best global layout that fits, twod 1D and TorchRec DMP 1D.

The skewed workload (``scaling.WORKLOADS["skewed"]``, synthetic): one table of 4 M rows x 64
(1 GiB of fp32 rows) and 26 Criteo-like tables of 100 k rows, 4,096 samples per rank. With
``memory_per_rank_gb=1.75`` (``scaling.PER_TABLE_BUDGET_GB``) the large table does not fit twice:
every global layout with two copies (groups of 2 or 1) is out of memory, so the best global layout
that fits is 1D, ``twod 1x4``. The per-table cells let the planner choose every table's group size
(``shard_group_size="auto"``, links measured at set-up) at a reduction every 8 and every 32 steps
(overlapped, bf16); one more at every 8 steps plans on the links ``lightning-twod calibrate``
measured on the testbed beforehand (``links=FILE``, ``build/calibration/links_<rate>.yaml``, measured
first when missing) instead of the short probe of each set-up; and the layout the method intends
for this model is pinned (the large table 1D, the others in groups of 2: ``sharding={"t_cat_0":
{"shard_group_size": 4}}``, interval 8), which shows what that layout gives whatever the planner
chooses. One sitting: 3 interleaved rounds at 1 Gbit/s between the two namespaces (``cluster.py``); prints, and writes to ``OUT/per_table.md``, the ratios of each round
(throughput: the baseline's ms per step over the cell's), their median, the load average of each
round, what the planner chose for each table, and where each cell's step goes.

``--explain`` measures the testbed's links at the rate (``calibration.links_for``, kept in
``build/calibration``) and writes ``OUT/prediction.md``: the planner's predicted step, by phase,
of the 1D layout, the pinned per-table layout and the planner's own per-table choice, with what
the search weighed per table, to set next to the measured phases of ``per_table.md``.

    bash benchmarks/setup_torchrec.sh      # once: TorchRec's own environment
    python benchmarks/per_table.py         # OUT = benchmarks/results/per_table
    python benchmarks/per_table.py --explain
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import overlap  # noqa: E402
import scaling  # noqa: E402

CELLS = {"1d": "twod 1x4", "torchrec": "torchrec dmp 1d", "k8": "twod per-table auto k8 overlap bf16",
         "k32": "twod per-table auto k32 overlap bf16", "calibrated": "twod per-table auto k8 overlap bf16 calibrated",
         "pinned8": "twod per-table pinned k8 overlap bf16"}
QUICK_CELLS = {"1d": "twod 1x4", "torchrec": "torchrec dmp 1d", "k8": "twod per-table auto k2 overlap bf16",
               "calibrated": "twod per-table auto k2 overlap bf16 calibrated",
               "pinned8": "twod per-table pinned k2 overlap bf16"}
# (the cell, its baseline, target); the best global layout that fits is 1D (see the docstring)
RATIOS = [("k8", "1d", 1.3), ("k32", "1d", 1.3), ("calibrated", "1d", 1.3), ("pinned8", "1d", None),
          ("1d", "torchrec", None), ("k8", "torchrec", None), ("k32", "torchrec", None),
          ("calibrated", "torchrec", None)]
#: where calibration.links_for keeps the testbed's links: the folder the calibrated cell reads them from
LINKS_DIR = Path(scaling.CALIBRATED_LINKS).parent


def chosen_sizes(result: dict, cell: str) -> str:
    """What the planner gave each table in ``cell`` (rank 0), ``S: tables``, per round where rounds differ."""
    chosen = []
    for record in result["rounds"].get(cell, []):
        by_size: dict[int, list[str]] = {}
        for table, size in (record.get("group_sizes") or {}).items():
            by_size.setdefault(size, []).append(table)
        chosen.append("; ".join(f"groups of {s}: {', '.join(t) if len(t) < 6 else f'{len(t)} tables'}"
                                for s, t in sorted(by_size.items())) or "not recorded")
    if len(set(chosen)) <= 1:
        return chosen[0] if chosen else "not recorded"
    return "; ".join(f"round {record['round']}: {text}" for record, text in zip(result["rounds"][cell], chosen,
                                                                               strict=True))


def write_report(data: dict, path: Path, cells: dict[str, str]) -> str:
    ratios = [r for r in RATIOS if r[0] in cells and r[1] in cells]
    lines = ["# Per-table group sizes on the two-node testbed (`benchmarks/per_table.py`)", "",
             "Ratios are throughput ratios: the baseline's ms per step over the cell's (above 1: the cell is faster). "
             "The best global layout that fits the memory budget is 1D (`twod 1x4`).", ""]
    for workload, rates in data["results"].items():
        for rate, result in rates.items():
            summary = result["summary"]
            lines += [f"## {workload}, {rate}", ""] + overlap.ratio_and_step_tables(result, cells, ratios)
            lines += ["", "What the planner chose per table:", ""]
            lines += [f"* `{cell}`: {chosen_sizes(result, cell)}" for key, cell in cells.items()
                      if key in ("k8", "k32", "calibrated", "pinned8")]
            lines += ["", "Where the step goes (ms per step, the cell's median round; `throughput.breakdown`):", ""]
            lines += overlap.phase_table(summary, cells)
            lines.append("")
    return overlap.write_page(lines, data, path)


def testbed_links(rate: str):
    """The links ``lightning-twod calibrate`` measures on the testbed at ``rate`` (measured when missing)."""
    import calibration

    return calibration.links_for(rate, argparse.Namespace(work_dir=LINKS_DIR, remeasure=False,
                                                          budget_s=calibration.PROBE_BUDGET_S))


def explain(rate: str, out: Path) -> str:
    """The planner's step by phase for the cells' layouts on the testbed's links at ``rate``."""
    import calibration

    from lightning_twod.models.dlrm import DLRM
    from lightning_twod.planner import DenseModel, StepTime, Workload
    from lightning_twod.planner.layout import specs_from_configs
    from lightning_twod.planner.per_table import PerTableSearch, describe_tables
    from lightning_twod.planner.plan import format_gib
    from lightning_twod.sparse.wrap import embedding_tables

    work = scaling.WORKLOADS["skewed"]
    links = testbed_links(rate)
    model = DLRM(table_rows=work.table_rows, embedding_dim=work.dim, num_dense=13, bottom_mlp=work.bottom,
                 top_mlp=work.top)
    table_params = sum(rows * work.dim for rows in work.table_rows)
    dense = DenseModel(sum(p.numel() for p in model.parameters()) - table_params)
    specs = specs_from_configs(embedding_tables(model))
    workload = Workload(batch_size=work.batch, optimizer="rowwise_adagrad", sync_interval=8, sync_bytes=2,
                        sync_overlap=True)
    search = PerTableSearch(specs, work.world, "contiguous", calibration.RANKS_PER_NODE,
                            scaling.PER_TABLE_BUDGET_GB * 2**30, workload, links, dense)
    names = search.tables
    one_d = search.evaluate(dict.fromkeys(names, 4))
    layouts = {"1D (`twod 1x4`)": one_d, "pinned: t_cat_0 in groups of 4, the rest of 2":
               search.evaluate({**dict.fromkeys(names, 2), "t_cat_0": 4}),
               "the search's own choice, from 1D": search.search(dict.fromkeys(names, 4), {})}
    short = [StepTime.SHORT[p] for p in StepTime.PHASES]
    lines = [f"# What the planner predicts for the per-table cells ({rate}, links `{links.name}`)", "",
             "Interval 8, overlapped, bf16; milliseconds per step by phase (`StepTime`); the budget is "
             f"{scaling.PER_TABLE_BUDGET_GB} GiB per rank.", "",
             "| layout | step | " + " | ".join(short) + " | busiest rank |",
             "|---|---:|" + "---:|" * len(short) + "---:|"]
    for label, found in layouts.items():
        if not found.fits:
            lines.append(f"| {label} | {found.error} |" + " |" * (len(short) + 1))
            continue
        phases = " | ".join(f"{getattr(found.time, p) * 1e3:.1f}" for p in found.time.PHASES)
        lines.append(f"| {label} | {found.time.total * 1e3:.1f} | {phases} | {format_gib(found.memory)} |")
    lines += ["", "Per table, the step predicted with it in groups of each other size (from 1D):", "", "```",
              *describe_tables(search, one_d), "```", ""]
    text = "\n".join(lines)
    (out / "prediction.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = overlap.sitting_parser(__doc__, "per_table")
    parser.add_argument("--explain", action="store_true", help="the planner's prediction by phase (measures links)")
    args = parser.parse_args(argv)
    if args.explain:
        print(explain(args.rate, args.out_dir))
        return 0
    if not args.report_only:
        testbed_links(args.rate)  # the calibrated cell's links: measured first when missing
    cells = QUICK_CELLS if args.quick else CELLS
    return overlap.run_and_report(args, cells, ["skewed"], write_report, "per_table.md")


if __name__ == "__main__":
    sys.exit(main())
