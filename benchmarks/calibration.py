"""The planner's step-time model against measured cells of the scaling benchmark (``scaling.py``).

For every ``twod`` cell of the runs (``scaling.py``'s JSON lines: ``build/scaling/runs.jsonl``), the
median step over its rounds is set next to the prediction of ``lightning_twod.planner.steptime``
for the same layout, interval, overlap, wire type, workload and link rate, and the script writes
``calibration.md`` (a summary per workload and rate, every cell outside the bar with the part of its
step that differs most, then a table per workload and rate: the error of every cell, and whether
the layout ``shard_group_size="auto", placement="auto"`` picks is within 10 % of the
measured-fastest one) and
``calibration.png`` (predicted against measured): the page to ``--out-dir`` (default
``benchmarks/results``, in git), the figure to its twin under ``benchmarks/out`` (git-ignored;
beside the page when ``--out-dir`` is not under ``benchmarks/results``: ``outputs.py``).

The prediction's inputs are measured on the machine the runs came from, never taken from the runs:

* the links of each rate: ``python -m lightning_twod calibrate`` run on the two-node testbed at that
  rate (``links_<rate>.yaml`` in ``--work-dir``), with the share of an overlapped collective's
  time that the compute beside it still pays;
* the step of each workload with nothing to exchange: the same training (``scaling_workers.py``)
  with one rank per shard group and no reduction in the timed window, 4 ranks on the unshaped
  testbed (``local_<workload>.json``): dense layers, kernels and framework, under the same
  sharing of the CPU cores. The model adds the all-to-alls, the reduction and the dense
  all-reduce's exposure on the cell's links. The prediction from the FLOP rule at the probe's
  dense throughput (what the strategy assumes at set-up) is listed next to it.

Missing inputs are measured (needs root for the testbed, a few minutes); ``--remeasure`` measures
them again. Re-run on a new grid with the same command::

    python benchmarks/calibration.py --runs build/scaling/runs.jsonl [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from argparse import Namespace
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]
import scaling  # noqa: E402
import workload as W  # noqa: E402

from benchmarks import testbed  # noqa: E402
from benchmarks.outputs import figure_line, raw_dir  # noqa: E402
from lightning_twod.planner import (  # noqa: E402
    PRESETS,
    DenseModel,
    LinkModel,
    StepTime,
    TableSpec,
    Workload,
    choose_layout,
    plan_model,
    step_time,
)
from lightning_twod.strategies.planning import DEFAULT_PLANNER_BATCH  # noqa: E402

#: The calibration targets: every cell's prediction within 25 % of its measured step, and the
#: layout the model picks within 10 % of the measured-fastest one of its workload and rate.
TOLERANCE = 0.25
AUTO_TOLERANCE = 0.10
#: The testbed: 4 ranks, 2 per network namespace ("node").
WORLD, RANKS_PER_NODE = 4, 2
#: Budget of the links probe here (s): longer than at set-up, for steadier numbers.
PROBE_BUDGET_S = 10.0
#: The batch the runs' plans were made for: the strategy's default, since neither the runs' model
#: nor their data loader has a ``batch_size``.
PLANNER_BATCH = DEFAULT_PLANNER_BATCH
LAYOUT_NAMES = {(4, "contiguous"): "1x4", (2, "contiguous"): "2x2c", (2, "strided"): "2x2s", (1, "contiguous"): "4x1"}
LOCAL_CELL = dict(name="local step (S=1, no reduction)", family="twod", system="twod", layout="4x1", shard=1,
                  placement="contiguous", interval=scaling.NEVER, overlap=False, dtype="fp32", warmup=3, steps=16)


# ----------------------------------------------------------------------------- the workloads
def workload_of(record: dict) -> W.Workload:
    """The benchmark workload a run record was made with (full or ``--quick``), by its fingerprint."""
    cell = {k: v for k, v in record["cell"].items() if k != "fingerprint"}
    for table in (scaling.WORKLOADS, scaling.QUICK):
        work = table[record["workload"]]
        if scaling.fingerprint(work, cell) == record["cell"]["fingerprint"]:
            return work
    return scaling.WORKLOADS[record["workload"]]


def specs_of(work: W.Workload) -> dict[str, list[TableSpec]]:
    """The benchmark DLRM's tables as the planner sees them (``workload.make_rank_batches``)."""
    ids = (work.min_ids + work.max_ids) / 2
    return {"sparse": [TableSpec(f"t_cat_{i}", work.rows, work.dim, pooling_factor=ids, id_skew=work.skew)
                       for i in range(work.num_tables)]}


def dense_of(work: W.Workload, local_seconds: float | None = None) -> DenseModel:
    """The benchmark model's dense part: parameters, and FLOPs per sample (6 x the multiply-adds of
    its linear layers and of the DLRM interaction's batched matrix product; the bare model's one
    linear layer, ``workload.bare_head``)."""
    if work.model == "bare":
        inputs = work.num_tables * work.dim
        return DenseModel(inputs + 1, 6.0 * inputs, local_seconds)
    bottom = [W.NUM_DENSE, *work.bottom, work.dim]
    top = [W.top_input_size(work), *work.top, 1]
    linear = [(a, b) for sizes in (bottom, top) for a, b in zip(sizes, sizes[1:])]
    params = sum(a * b + b for a, b in linear)
    vectors = work.num_tables + 1
    macs = sum(a * b for a, b in linear) + vectors * vectors * work.dim
    return DenseModel(params, 6.0 * macs, local_seconds)


def workload_for(cell: dict, work: W.Workload) -> Workload:
    from lightning_twod.planner.inputs import SYNC_BYTES

    return Workload(batch_size=work.batch, sync_interval=cell["interval"], sync_bytes=SYNC_BYTES[cell["dtype"]],
                    sync_overlap=cell["overlap"])


# ----------------------------------------------------------------------------- measured inputs
_MEASURED: set[Path] = set()  # inputs measured by this run: --remeasure measures each one once


def _stale(path: Path, args: Namespace) -> bool:
    """Whether ``path`` must be measured (again) now; marks it measured."""
    stale = not path.exists() or (args.remeasure and path not in _MEASURED)
    _MEASURED.add(path)
    return stale


def links_for(rate: str, args: Namespace) -> LinkModel:
    """``links_<rate>.yaml`` of the work dir, measured on the testbed at ``rate`` when missing."""
    path = args.work_dir / f"links_{rate}.yaml"
    if _stale(path, args):
        print(f"measuring the links at {rate} on the testbed ({args.budget_s:g} s probe)", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        with testbed.two_nodes(rate=rate) as bed:
            bed.run(Path(__file__), ["--probe", "--out", str(path), "--name", f"testbed-{rate}",
                                     "--budget-s", str(args.budget_s)],
                    nproc_per_node=RANKS_PER_NODE, timeout=600, log_dir=args.work_dir / f"probe-{rate}",
                    cwd=ROOT).check()
    return LinkModel.load(path)


def local_step(name: str, work: W.Workload, args: Namespace) -> float:
    """Seconds of ``work``'s step with nothing to exchange (``local_<name>.json``), measured when missing."""
    path = args.work_dir / f"local_{name}.json"
    if _stale(path, args):
        print(f"measuring the local step of {name} on the unshaped testbed", flush=True)
        runs = args.work_dir / f"local_{name}.jsonl"
        runs.unlink(missing_ok=True)
        job = Namespace(work_dir=args.work_dir / "local", cache=runs, job_timeout=1800, quick=False)
        batches, long = scaling.batch_folder(job, work)
        if not (batches / f"rank{work.world - 1}.pt").exists():
            W.make_rank_batches(long, str(batches))
        cell = {**LOCAL_CELL, "fingerprint": scaling.fingerprint(work, LOCAL_CELL)}
        with testbed.two_nodes(rate=None) as bed:
            scaling.run_job(bed, "twod", name, work, [cell], {"workload": name, "rate": "unshaped", "round": 0},
                            job, batches)
        row = scaling.aggregate(json.loads(runs.read_text().splitlines()[-1]))
        if "error" in row:
            raise RuntimeError(f"the local step of {name} failed: {row['error'][-500:]}")
        path.write_text(json.dumps({"step_ms": row["step_ms"], "step_ms_median": row["step_ms_median"],
                                    "loadavg": row["loadavg"], "workload": asdict(work)}, indent=1))
    return json.loads(path.read_text())["step_ms"] / 1e3


# ----------------------------------------------------------------------------- measured cells
def measured_cells(paths: list[Path]) -> dict[tuple[str, str], dict[str, dict]]:
    """``{(workload, rate): {cell name: summary over rounds}}`` of the ``twod`` cells, with the cell,
    its workload and its load averages."""
    rows: dict[tuple[str, str], dict[str, list]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if record["cell"].get("family") != "twod":
                continue
            row = scaling.aggregate(record)
            if "error" not in row:
                entry = rows.setdefault((record["workload"], record["rate"]), {}).setdefault(record["cell"]["name"], [])
                entry.append((row, record))
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for key, cells in rows.items():
        for name, entries in cells.items():
            summary = scaling.summarize([row for row, _ in entries])
            record = entries[-1][1]
            summary.update(cell=record["cell"], work=workload_of(record), loads=[row["loadavg"] for row, _ in entries],
                           source=sorted({str(p) for p in paths}))
            out.setdefault(key, {})[name] = summary
    return out


# ----------------------------------------------------------------------------- predictions
def predict(cell: dict, work: W.Workload, links: LinkModel, dense: DenseModel) -> StepTime:
    """The step of ``cell`` on ``links``: the plan the strategy made for it (the h100 preset balances
    a pinned layout, planned for ``PLANNER_BATCH``), timed at the run's batch."""
    specs = specs_of(work)
    plan = plan_model(specs, WORLD, cell["shard"], Workload(batch_size=PLANNER_BATCH), placement=cell["placement"],
                      ranks_per_node=RANKS_PER_NODE, links=PRESETS["h100"])
    return step_time(specs, plan.modules, WORLD, cell["shard"], cell["placement"], RANKS_PER_NODE,
                     workload_for(cell, work), links, dense)


def predicted_payload(cell: dict, work: W.Workload) -> float:
    """Bytes a rank puts in one round's payload all-reduce (with the int8 wire's scales), per the
    model (0 without a reduction)."""
    from lightning_twod.planner.reduction import reduction_rounds

    if cell["shard"] == WORLD:
        return 0.0
    specs = specs_of(work)["sparse"]
    plan = plan_model({"sparse": specs}, WORLD, cell["shard"], Workload(batch_size=PLANNER_BATCH),
                      placement=cell["placement"], ranks_per_node=RANKS_PER_NODE, links=PRESETS["h100"])
    workload = workload_for(cell, work)
    rounds, _ = reduction_rounds(specs, plan.modules["sparse"], cell["shard"], WORLD // cell["shard"], workload)
    return max(r.payload_bytes(workload) - r.mask_bytes for r in rounds)


def auto_choice(settings: tuple, work: W.Workload, links: LinkModel, dense: DenseModel) -> str:
    """The layout ``shard_group_size="auto", placement="auto"`` picks for these settings (interval,
    overlap, wire type), as a layout name of the grid."""
    interval, overlap, dtype, _ = settings  # the model takes no account of input-dist pipelining
    cell = dict(interval=interval, overlap=overlap, dtype=dtype)
    best, _, _ = choose_layout(specs_of(work), WORLD, RANKS_PER_NODE, float("inf"), workload_for(cell, work), links,
                               dense)
    return LAYOUT_NAMES[(best.group_size, best.placement)]


def evaluate(measured: dict, args: Namespace) -> dict:
    """Every cell's prediction and error, and the auto choice per workload, rate and settings."""
    results = {}
    for (name, rate), cells in sorted(measured.items()):
        links = links_for(rate, args)
        work = next(iter(cells.values()))["work"]
        local = local_step(name, work, args)
        dense, flop_dense = dense_of(work, local), dense_of(work)
        rows = []
        for cell_name, summary in cells.items():
            cell = summary["cell"]
            time, flops = predict(cell, work, links, dense), predict(cell, work, links, flop_dense)
            payload = summary.get("payload_bytes_per_round")
            model_payload = predicted_payload(cell, work)
            stale = bool(payload) and abs(payload / model_payload - 1) > 0.1 if model_payload else False
            rows.append(dict(cell=cell_name, layout=cell["layout"], settings=_settings(cell), measured=summary["step_ms"],
                             rounds=summary["step_ms_rounds"], predicted=time.total * 1e3, flop_rule=flops.total * 1e3,
                             phases={p: getattr(time, p) * 1e3 for p in StepTime.PHASES},
                             measured_reduction=summary.get("reduction_ms_per_step", 0.0),
                             measured_a2a=sum(summary["phases_ms"].get(k, 0.0) for k in ("output_dist",
                                                                                         "output_dist_backward")),
                             payload_mib=(payload or 0) / 2**20, model_payload_mib=model_payload / 2**20,
                             stale=stale, loads=summary["loads"]))
        for row in rows:
            row["error"] = row["predicted"] / row["measured"] - 1
        results[(name, rate)] = dict(rows=rows, local_ms=local * 1e3, links=links, choices=_choices(rows, work, links,
                                                                                                     dense))
    return results


def _settings(cell: dict) -> tuple:
    """What a layout choice holds fixed: interval, overlap, wire type, and input-dist pipelining."""
    return (cell["interval"], cell["overlap"], cell["dtype"], cell.get("pipeline", False))


def _choices(rows: list[dict], work: W.Workload, links: LinkModel, dense: DenseModel) -> list[dict]:
    """Per settings measured with at least two layouts: the model's pick against the fastest measured,
    every layout (1D included) with the same pipelining (the bound cells, with no round in their
    window, are no setting a user can pick)."""
    out = []
    for settings in sorted({r["settings"] for r in rows if r["layout"] != "1x4" and r["settings"][0] != scaling.NEVER}):
        one_d = [r for r in rows if r["layout"] == "1x4" and r["settings"][3] == settings[3] and not r["stale"]]
        pool = [r for r in rows if r["settings"] == settings and r["layout"] != "1x4" and not r["stale"]] + one_d
        if len({r["layout"] for r in pool}) < 2:
            continue
        pick = auto_choice(settings, work, links, dense)
        fastest = min(pool, key=lambda r: r["measured"])
        picked = next((r for r in pool if r["layout"] == pick), None)
        out.append(dict(settings=settings, pick=pick, fastest=fastest["layout"], fastest_ms=fastest["measured"],
                        picked_ms=picked["measured"] if picked else None,
                        within=None if picked is None else picked["measured"] <= (1 + AUTO_TOLERANCE) * fastest["measured"],
                        layouts=sorted({r["layout"] for r in pool})))
    return out


# ----------------------------------------------------------------------------- outputs
def _fmt_settings(settings: tuple) -> str:
    interval, overlap, dtype, pipelined = settings
    return f"k{interval} {'overlap' if overlap else 'blocking'} {dtype}" + (" pipelined" if pipelined else "")


def _parts(r: dict) -> list[tuple[str, float, float]]:
    """(part, measured ms, predicted ms) of a cell: the output all-to-all, the cross-group reduction,
    and the rest of the step (what the local step and the other phases stand for)."""
    rest = (r["measured"] - r["measured_a2a"] - r["measured_reduction"],
            r["predicted"] - r["phases"]["output_all_to_all"] - r["phases"]["reduction"])
    return [("out a2a", r["measured_a2a"], r["phases"]["output_all_to_all"]),
            ("x-group", r["measured_reduction"], r["phases"]["reduction"]), ("rest", *rest)]


def _median(values: list[float]) -> str:
    import statistics

    return f"{statistics.median(values):+.0%}" if values else "-"


def summary_lines(results: dict) -> list[str]:
    """Per workload and rate: cells within the bar, median errors, worst cell; then every cell outside
    it with the part of the step (measured / predicted) that differs most."""
    lines = [f"| workload, rate | cells within {TOLERANCE:.0%} | median error, blocking | median error, overlapped "
             "| worst cell |", "|---|---:|---:|---:|---|"]
    misses = []
    for (name, rate), res in results.items():
        rows = [r for r in res["rows"] if not r["stale"]]
        worst = max(rows, key=lambda r: abs(r["error"]))
        lines.append(f"| {name}, {rate} | {sum(abs(r['error']) <= TOLERANCE for r in rows)} of {len(rows)} | "
                     f"{_median([r['error'] for r in rows if not r['settings'][1]])} | "
                     f"{_median([r['error'] for r in rows if r['settings'][1]])} | "
                     f"`{worst['cell'].replace('twod ', '')}` {worst['error']:+.0%} |")
        for r in sorted(rows, key=lambda r: r["cell"]):
            if abs(r["error"]) > TOLERANCE:
                part, measured, predicted = max(_parts(r), key=lambda p: abs(p[1] - p[2]))
                misses.append(f"* {name}, {rate}, `{r['cell']}`: {r['error']:+.0%} ({r['measured']:.0f} ms measured, "
                              f"{r['predicted']:.0f} predicted); most of it in {part}: {measured:.0f} ms measured, "
                              f"{predicted:.0f} predicted")
    if misses:
        lines += ["", f"Cells outside {TOLERANCE:.0%}, and the part of the step that differs most (out a2a: the "
                  "output all-to-all forward and backward; x-group: the reduction's time per step; rest: the step "
                  "less those two). `docs/planner.md` says why:", "", *misses]
    return lines


def write_markdown(results: dict, path: Path, figure: Path, sources: list[Path]) -> None:
    cells = [r for res in results.values() for r in res["rows"] if not r["stale"]]
    within = sum(abs(r["error"]) <= TOLERANCE for r in cells)
    choices = [c for res in results.values() for c in res["choices"]]
    good = sum(bool(c["within"]) for c in choices)
    lines = ["# Calibration: the planner's step-time model against the testbed", "",
             f"Written by `python benchmarks/calibration.py --runs {' '.join(str(s.relative_to(ROOT)) if s.is_relative_to(ROOT) else str(s) for s in sources)}` "
             "(see its docstring): every `twod` cell of the runs (median over its rounds) next to the prediction of "
             "`lightning_twod/planner/steptime.py` for the same layout, interval, overlap, wire type, workload and "
             "link rate. Inputs of the prediction, measured on this machine and not taken from the runs: the links "
             "at each rate (`calibrate` on the testbed) and each workload's step with nothing to exchange (one rank "
             "per shard group, no reduction in the window). `FLOP rule`: the same prediction with the dense part "
             "from 6 x multiply-adds at the probe's dense throughput, as the strategy estimates it at set-up.", "",
             f"**Within {TOLERANCE:.0%}: {within} of {len(cells)} cells"
             + (f"; worst {max(cells, key=lambda r: abs(r['error']))['error']:+.0%}" if cells else "") + ".** "
             f"**Auto choice within {AUTO_TOLERANCE:.0%} of the measured-fastest layout: {good} of {len(choices)} "
             "settings.**", "", *summary_lines(results), "",
             figure_line(path, figure, "predicted vs measured"), ""]
    stale = [r for res in results.values() for r in res["rows"] if r["stale"]]
    if stale:
        lines += [f"{len(stale)} cell(s) moved a different payload per round than the model counts (an older "
                  "version of the reduction, before `DENSE_SHARE` = 0.9); they are listed but not counted.", ""]
    for (name, rate), res in results.items():
        links = res["links"]
        lines += [f"## {name}, {rate}", "",
                  f"Local step (measured): {res['local_ms']:.1f} ms. Links ({links.source}): all-to-all "
                  f"{links.all_to_all_intra.bandwidth / 1e9:.3g} GB/s inside a node, "
                  f"{links.all_to_all_inter.bandwidth / 1e9:.3g} GB/s per rank across; all-reduce "
                  f"{links.all_reduce_intra.bandwidth / 1e9:.3g} / {links.all_reduce_inter.bandwidth / 1e9:.3g} GB/s; "
                  f"copy {links.copy_bandwidth / 1e9:.3g} GB/s, lookup {links.lookup_bandwidth / 1e9:.3g} GB/s; "
                  f"an overlapped all-reduce costs the compute beside it {links.overlap_share:.0%} of its time.", "",
                  "| cell | measured ms (rounds) | predicted ms | error | FLOP rule ms | out a2a ms measured / predicted | "
                  "x-group ms measured / predicted | payload MiB measured / model | load avg |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in sorted(res["rows"], key=lambda r: r["cell"]):
            mark = " (older code)" if r["stale"] else ""
            loads = "; ".join(f"{a} -> {b}" for a, b in r["loads"])
            lines.append(f"| `{r['cell']}`{mark} | {r['measured']:.1f} ({', '.join(f'{x:.0f}' for x in r['rounds'])}) | "
                         f"{r['predicted']:.1f} | {r['error']:+.0%} | {r['flop_rule']:.1f} | "
                         f"{r['measured_a2a']:.0f} / {r['phases']['output_all_to_all']:.0f} | "
                         f"{r['measured_reduction']:.0f} / {r['phases']['reduction']:.0f} | "
                         f"{r['payload_mib']:.1f} / {r['model_payload_mib']:.1f} | {loads} |")
        if res["choices"]:
            lines += ["", "| settings | layouts measured | auto picks | measured-fastest | picked / fastest ms | within 10 % |",
                      "|---|---|---|---|---:|---|"]
            for c in res["choices"]:
                ratio = f"{c['picked_ms']:.0f} / {c['fastest_ms']:.0f}" if c["picked_ms"] else "not measured"
                verdict = {True: "yes", False: "**no**", None: "-"}[c["within"]]
                lines.append(f"| {_fmt_settings(c['settings'])} | {', '.join(c['layouts'])} | {c['pick']} | "
                             f"{c['fastest']} | {ratio} | {verdict} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    markers = {"1gbit": "o", "10gbit": "s", "unshaped": "^"}
    colors = {"criteo": "#1f77b4", "pooled": "#d62728"}
    rows = [(key, r) for key, res in results.items() for r in res["rows"]]
    for (name, rate), r in rows:
        left.scatter(r["measured"], r["predicted"], marker=markers.get(rate, "x"), color=colors.get(name, "gray"),
                     facecolors="none" if r["stale"] else None, label=f"{name}, {rate}")
    values = [v for _, r in rows for v in (r["measured"], r["predicted"])] or [1, 10]
    lo, hi = min(values) * 0.8, max(values) * 1.2
    left.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    for f in (1 - TOLERANCE, 1 + TOLERANCE):
        left.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.8)
    left.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms per step",
             ylabel="predicted ms per step", title=f"predicted vs measured (dotted: +-{TOLERANCE:.0%}; hollow: older code)")
    handles, labels = left.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    left.legend(unique.values(), unique.keys(), fontsize=8)
    names = [f"{key[0]} {key[1]} {r['cell'].replace('twod ', '')}" for key, r in rows]
    right.barh(names, [100 * r["error"] for _, r in rows],
               color=["#bbbbbb" if r["stale"] else colors.get(k[0], "gray") for k, r in rows])
    right.axvline(100 * TOLERANCE, color="k", ls=":")
    right.axvline(-100 * TOLERANCE, color="k", ls=":")
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=6)
    right.set(xlabel="prediction error (%)", title="error per cell")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--runs", type=Path, nargs="+", default=[ROOT / "build" / "scaling" / "runs.jsonl"],
                        help="scaling.py's JSON lines (default build/scaling/runs.jsonl)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "build" / "calibration",
                        help="measured links and local steps (default build/calibration)")
    parser.add_argument("--remeasure", action="store_true", help="measure the links and local steps again")
    parser.add_argument("--budget-s", type=float, default=PROBE_BUDGET_S, help="seconds of each links probe")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # one rank of the links probe
    args, rest = parser.parse_known_args(argv)
    if args.probe:
        from lightning_twod.cli.calibrate import calibrate_main

        return calibrate_main([*rest, "--budget-s", str(args.budget_s)])
    measured = measured_cells(args.runs)
    if not measured:
        print(f"no twod cells in {', '.join(map(str, args.runs))}", file=sys.stderr)
        return 2
    results = evaluate(measured, args)
    raw = raw_dir(args.out_dir)
    for folder in (args.out_dir, raw):
        folder.mkdir(parents=True, exist_ok=True)
    plot(results, raw / "calibration.png")
    write_markdown(results, args.out_dir / "calibration.md", raw / "calibration.png", args.runs)
    for (name, rate), res in results.items():
        for r in sorted(res["rows"], key=lambda r: r["cell"]):
            print(f"{name:<7} {rate:<9} {r['cell']:<34} measured {r['measured']:8.1f} predicted {r['predicted']:8.1f} "
                  f"({r['error']:+.0%}){' older code' if r['stale'] else ''}")
    print(f"written {args.out_dir / 'calibration.md'} and {raw / 'calibration.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
