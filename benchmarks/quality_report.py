"""Tables, plot and reading aids of ``benchmarks/quality.py``: the page to ``benchmarks/results``, the plot to ``benchmarks/out``."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.outputs import figure_line, raw_dir


def _stats(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def _layout_speed(config, speeds: dict) -> float | None:
    """Steps/s of the real run with the same mesh (world size and group size) as ``config``."""
    layouts = {(1, 1): "single", (4, 4): "1d", (4, 2): "2d_rowwise", (4, 1): "w4_m4",
               (8, 8): "w8_1d", (8, 4): "w8_m2", (8, 2): "w8_m4", (8, 1): "w8_m8"}
    return speeds.get(layouts.get((config.world, config.group), ""))


def _short(runs: list[dict], seeds: int) -> str:
    """`` (n seeds)`` after a cell that holds fewer than the study's ``seeds`` (a partial study)."""
    return f" ({len(runs)} seed{'s' * (len(runs) > 1)})" if len(runs) < seeds else ""


def _speed(name: str, value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mean(values: list[float]) -> float:
    return statistics.mean(values)


def _command(args, names: list[str], study=None) -> list[str]:
    from benchmarks.quality import CONFIGS

    optimizer = getattr(args, "optimizer", "rowwise_adagrad")
    words = [f"--dataset {args.dataset}"] + ([f"--optimizer {optimizer}"] if optimizer != "rowwise_adagrad" else [])
    words += ["--table-dtype fp16"] if getattr(args, "table_dtype", "fp32") == "fp16" else []
    words += [f"--seeds {args.seeds}", f"--epochs {args.epochs}"]
    if getattr(args, "paired_seeds", 0) > args.seeds:
        words.append(f"--paired-seeds {args.paired_seeds}")
    if args.steps:
        words.append(f"--steps {args.steps}")
    words.append("--lrs " + " ".join(f"{lr:g}" for lr in args.lrs))
    if names != [c.name for c in (CONFIGS if study is None else study)]:
        words.append("--configs " + " ".join(names))
    return words


def write_report(configs, args, runs: dict, traffic, config_path: Path, out: Path, suffix: str = "",
                 planted: dict | None = None, study=None) -> Path:
    """``out/quality<suffix>.md`` (``benchmarks/results`` by default) from the finished runs, and its figure
    ``quality<suffix>_curves.png`` in ``outputs.raw_dir(out)``; the page's path. ``study``: the
    configurations of ``args.study`` (``quality.CONFIGS`` when None); a study other than row-wise
    AdaGrad's gets a table of every configuration against 1D, paired by seed, and where 1D also runs with
    fp16 tables (the fp16 study), a second one against that 1D."""
    study_name = getattr(args, "study", getattr(args, "optimizer", "rowwise_adagrad"))
    adagrad, half = study_name == "rowwise_adagrad", study_name == "fp16"
    raw = raw_dir(out)
    for folder in (out, raw):
        folder.mkdir(parents=True, exist_ok=True)
    by, paired = {}, {}
    paired_seeds = max(args.seeds, getattr(args, "paired_seeds", 0))
    for (name, lr, seed, epochs, steps), run in runs.items():
        if epochs == args.epochs and steps == args.steps and lr in args.lrs and seed < paired_seeds:
            paired.setdefault(name, {}).setdefault(lr, []).append(run)
            if seed < args.seeds:
                by.setdefault(name, {}).setdefault(lr, []).append(run)
    names = [c.name for c in configs if c.name in by]

    def best_lr(name: str) -> float:
        """The rate of the best mean AUC among those with the most seeds (all of them, unless the study is partial)."""
        most = max(len(runs) for runs in by[name].values())
        return max((lr for lr, runs in by[name].items() if len(runs) == most),
                   key=lambda lr: _mean([r["auc"] for r in by[name][lr]]))

    reference = "1d" if "1d" in by else next((n for n in names if n.endswith("1d")), names[0])
    shared = best_lr(reference)
    if planted is None:
        title = "MovieLens-100K"
        model = f"the DLRM of `{config_path.relative_to(config_path.parents[2])}`"
        data_note = "validation split of 10,000 ratings"
    else:
        title = "SYNTHETIC Criteo-like clicks (planted model)"
        model = "a DLRM over 13 dense and 26 sparse features (`SYNTHETIC_ROWS` in the script)"
        data_note = (f"validation: 8,192 samples; the planted model's own scores reach AUC {planted['auc']:.4f}, "
                     f"NE {planted['ne']:.4f}, log loss {planted['logloss']:.4f} (the best achievable)")
    if half:
        model += (", every table in fp16 (`EmbeddingTableConfig(dtype=\"fp16\")`: fp16 rows, fp32 optimizer state) "
                  f"but in `{reference}`; sparse optimizer: row-wise AdaGrad in 1D, momentum-scaled row-wise AdaGrad "
                  "with c = M (the replicas) in 2D")
    elif not adagrad:
        model += f", sparse optimizer `{args.optimizer}` (betas 0.9 and 0.999, no weight decay)"
    subject = "fp16 tables" if half else f"`{args.optimizer}`"
    lines = [
        f"# Quality: 2D layout vs optimizer on {title}" if adagrad else f"# Quality of {subject}: 1D vs 2D on {title}",
        "",
        f"Model: {model}; "
        f"{args.epochs} epoch(s), {args.seeds} seed(s) (model initialization and data order), the same "
        "256 training samples per step in every configuration (split over its ranks); " + data_note +
        ". Sparse learning-rate sweep: " + ", ".join(f"{lr:g}" for lr in args.lrs) +
        f". **Shared rate** = the best of `{reference}` (1D): {shared:g}. Dense part: Adam as configured.",
        "",
        "Runs: the strategy's arithmetic emulated in one process (`lightning_twod.testing.emulator`, equal to real "
        "multi-process runs to 1e-5 in `tests/system/test_emulation.py`" + (
            "; fp16 rows: equal with 2 copies, within an fp16 rounding a round with 4, where the strategy sums "
            "the copies' rows in fp16 and the emulator rounds their mean once; a `fp16sum` configuration sums them too" if half else "")
        + "). KB/step: bytes a rank sends per step "
        "inside its shard group (all-to-all) and across groups (replica reduction), from the planner's "
        "traffic model. Training speed is measured on real processes by `benchmarks/throughput.py` "
        "(`benchmarks/results/README.md`): the emulator's own speed says nothing about the strategy's. " + (
            "Real steps/s were timed for the MovieLens model only ([quality.md](quality.md))." if planted else
            "Real steps/s were timed with row-wise AdaGrad only ([quality.md](quality.md), per mesh)." if not adagrad
            else "Real steps/s: "
        "`python benchmarks/quality_speed.py`, the main-job model and its strategy settings (momentum "
        "scaling, a reduction every step) with 64 samples per rank, per mesh, on real processes of this "
        "2-core machine: 4 or 8 processes share 2 cores, so only the ratios between meshes of the same "
            "world size mean anything."),
        "",
        "Reproduce: `python benchmarks/quality.py " + " ".join(_command(args, [c.name for c in configs], study)) + "`",
        "",
        "| configuration | what | AUC @ shared lr | NE @ shared lr | log loss @ shared lr | own best lr | "
        "AUC @ own best | NE @ own best | intra KB/step | cross KB/step | real steps/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    info = {c.name: c for c in configs}
    speed_file = Path(__file__).resolve().parent / "results" / "quality_speed.json"
    timed = speed_file.exists() and planted is None and adagrad
    speeds = __import__("json").loads(speed_file.read_text()) if timed else {}
    for name in names:
        at_shared = by[name].get(shared, [])
        own = best_lr(name)
        at_own = by[name][own]
        kb = traffic(info[name])
        speed = _layout_speed(info[name], speeds)
        lines.append(
            f"| `{name}` | {info[name].what} | "
            + (f"{_stats([r['auc'] for r in at_shared])} | {_stats([r['ne'] for r in at_shared])} | "
               f"{_stats([r['logloss'] for r in at_shared])}{_short(at_shared, args.seeds)}" if at_shared else "- | - | -")
            + f" | {own:g}{_short(at_own, args.seeds)} | {_stats([r['auc'] for r in at_own])} | {_stats([r['ne'] for r in at_own])} | "
            f"{kb['intra_kb']:.1f} | {kb['cross_kb']:.1f} | {_speed(name, speed)} |"
        )
    lines += ["", "AUC by sparse learning rate (mean over seeds):", "",
              "| configuration | " + " | ".join(f"{lr:g}" for lr in args.lrs) + " |",
              "|---|" + "---|" * len(args.lrs)]
    for name in names:
        cells = [f"{_mean([r['auc'] for r in by[name][lr]]):.4f}" + _short(by[name][lr], args.seeds)
                 if lr in by[name] else "-" for lr in args.lrs]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += _paired_with_fp32(configs, paired, args.lrs, shared)
    if not adagrad:
        lines += _paired_with_reference(names, paired, args.lrs, shared, reference, {n: best_lr(n) for n in names})
        half_1d = next((n for n in names if n != reference and info[n].replicas == 1), None) if half else None
        if half_1d:  # 2D with fp16 tables against 1D with fp16 tables, at the rates of that 1D
            others = [n for n in names if n != reference]
            lines += _paired_with_reference(others, paired, args.lrs, best_lr(half_1d), half_1d,
                                            {n: best_lr(n) for n in others}, rate_name=f"`{half_1d}`'s best")
        for name, twin in fp16_sum_twins(configs).items():
            if name in by and twin in by:
                lines += _paired_with_reference([name], paired, args.lrs, best_lr(twin), twin,
                                                label="its rows' mean rounded once", rate_name=f"`{twin}`'s best")
        lines += _rows_moved(names, paired, shared, reference)
    path = out / f"quality{suffix}.md"
    plot = _plot(by, names, best_lr, raw / f"quality{suffix}_curves.png", title)
    if plot:
        lines += ["", figure_line(path, plot, "validation AUC during training, each configuration at its own best rate")]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path


def fp32_twins(configs) -> dict[str, str]:
    """``{name: twin}`` for every configuration with another wire type or overlap whose fp32 blocking
    twin (the same otherwise) is among ``configs``."""
    from dataclasses import replace

    keyed = {replace(c, name="", what=""): c.name for c in configs}
    twins = {}
    for config in configs:
        twin = keyed.get(replace(config, name="", what="", sync_dtype="fp32", sync_overlap=False))
        if twin is not None and twin != config.name:
            twins[config.name] = twin
    return twins


def fp16_sum_twins(configs) -> dict[str, str]:
    """``{name: twin}`` for every configuration whose rounds sum fp16 rows in fp16 (``fp16_sum``) and whose
    twin that rounds their mean once (the same otherwise) is among ``configs``."""
    from dataclasses import replace

    keyed = {replace(c, name="", what=""): c.name for c in configs}
    twins = {c.name: keyed.get(replace(c, name="", what="", fp16_sum=False)) for c in configs if c.fp16_sum}
    return {name: twin for name, twin in twins.items() if twin is not None}


def paired_difference(runs: list[dict], twin_runs: list[dict], metric: str) -> tuple[float, float, int] | None:
    """Mean over the seeds both have of ``metric`` minus the twin's, its standard error, and the
    number of seeds (None without a common seed; a standard error of nan with one)."""
    mine = {r["seed"]: r[metric] for r in runs}
    base = {r["seed"]: r[metric] for r in twin_runs}
    diffs = [mine[s] - base[s] for s in sorted(set(mine) & set(base))]
    if not diffs:
        return None
    error = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return statistics.mean(diffs), error, len(diffs)


def _paired_with_fp32(configs, by: dict, lrs, shared: float) -> list[str]:
    """The table of configurations with another wire type or overlap against their fp32 blocking
    twin: per learning rate, the mean over seeds of the paired differences ± its standard error."""
    rows, seeds = [], set()
    for name, twin in fp32_twins(configs).items():
        if name not in by or twin not in by:
            continue
        cells = []
        for metric in ("auc", "ne"):
            diffs = []
            for lr in lrs:
                paired = paired_difference(by[name].get(lr, []), by[twin].get(lr, []), metric)
                if paired is not None:
                    seeds.add(paired[2])
                diffs.append("-" if paired is None else f"{paired[0]:+.4f} ± {paired[1]:.4f}")
            cells.append(" / ".join(diffs))
        rows.append(f"| `{name}` vs `{twin}` | {cells[0]} | {cells[1]} |")
    if not rows:
        return []
    rates = " / ".join(f"{lr:g}" + (" (shared)" if lr == shared else "") for lr in lrs)
    count = " or ".join(str(n) for n in sorted(seeds))
    return ["", "Wire type and overlap against the same configuration in fp32, blocking: the mean over "
            f"{count} seeds of the difference paired by seed (same initialization and data order), ± its "
            "standard error:", "",
            f"| configuration vs its fp32 twin | AUC difference at lr {rates} | NE difference |",
            "|---|---|---|", *rows]


def _paired_with_reference(names: list[str], by: dict, lrs, shared: float, reference: str,
                           best: dict[str, float] | None = None, label: str = "1D",
                           rate_name: str = "shared") -> list[str]:
    """The table of every configuration against ``reference`` (``label``, 1D by default): per learning rate, the mean over
    seeds of the paired AUC and NE differences ± its standard error; with ``best`` (each
    configuration's own best rate), also at its own best against the reference at ``shared`` (the rate the
    header marks with ``rate_name``)."""
    table = {}
    for name in names:
        if name == reference or name not in by or reference not in by:
            continue
        table[name] = {(metric, lr): paired_difference(by[name].get(lr, []), by[reference].get(lr, []), metric)
                       for metric in ("auc", "ne") for lr in lrs}
        if best:
            table[name].update({(metric, "best"): paired_difference(by[name].get(best[name], []),
                                                                    by[reference].get(shared, []), metric)
                                for metric in ("auc", "ne")})
    counts = [d[2] for cells in table.values() for d in cells.values() if d is not None]
    if not counts:
        return []
    most = max(counts)

    def cell(paired) -> str:
        if paired is None:
            return "-"
        return f"{paired[0]:+.4f} ± {paired[1]:.4f}" + (f" ({paired[2]} seeds)" if paired[2] < most else "")

    rows = [f"| `{name}` | " + " | ".join(" / ".join(cell(cells[metric, lr]) for lr in lrs) for metric in ("auc", "ne"))
            + ("" if not best else f" | {best[name]:g} | " + " | ".join(cell(cells[m, "best"]) for m in ("auc", "ne")))
            + " |" for name, cells in table.items()]
    rates = " / ".join(f"{lr:g}" + (f" ({rate_name})" if lr == shared else "") for lr in lrs)
    header = f"| configuration | AUC difference at lr {rates} | NE difference |"
    if best:
        header += f" own best lr | AUC: own best vs `{reference}` at {shared:g} | NE: own best vs `{reference}` at {shared:g} |"
    return ["", f"Against `{reference}` ({label}) at the same rate: the mean over {most} seeds (fewer where a cell says so) of "
            "the difference paired by seed (same initialization and data order), ± its standard error (AUC: above zero is "
            "better; NE: below zero is better)" + ("; and each configuration at its own best rate against 1D at its "
                                                   "best" + " (the shared rate)" * (rate_name == "shared") if best else "")
            + ":", "",
            header, "|---|---|---|" + "---|---|---|" * bool(best), *rows]


def _rows_moved(names: list[str], by: dict, lr: float, reference: str) -> list[str]:
    """The table of how far the item table's rows moved from their initialization at rate ``lr``,
    by the items' training ratings: ``reference``'s distance, and each other configuration's as a
    fraction of it, paired by seed (the mean over the seeds both recorded it ± its standard error)."""
    def moved(name: str) -> dict[int, dict[str, float]]:
        return {r["seed"]: r["moved"] for r in by.get(name, {}).get(lr, []) if "moved" in r}

    base = moved(reference)
    if not base:
        return []
    buckets = list(next(iter(base.values())))
    rows, seeds = [], set()
    for name in names:
        mine = moved(name)
        common = sorted(set(mine) & set(base))
        if not common:
            continue
        seeds.add(len(common))
        cells = []
        for bucket in buckets:
            values = ([base[s][bucket] for s in common] if name == reference
                      else [mine[s][bucket] / base[s][bucket] for s in common])
            spread = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
            cells.append(f"{statistics.mean(values):.3f}" + ("" if name == reference else "x") + f" ± {spread:.3f}")
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    count = " or ".join(str(n) for n in sorted(seeds))
    return ["", f"How far the item table's rows moved from their initialization at the shared rate {lr:g}, by the "
            "item's ratings in the training split (the mean L2 distance of the rows; the run's end, copies averaged): "
            f"`{reference}`'s distance, the others as a fraction of it paired by seed, over {count} seeds "
            "(the runs that recorded it), ± the standard error:", "",
            "| configuration | " + " | ".join(f"items with {b} ratings" for b in buckets) + " |",
            "|---|" + "---|" * len(buckets), *rows]


def _plot(by, names, best_lr, path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name in names:
        runs = by[name][best_lr(name)]
        steps = [p["step"] for p in runs[0]["curve"]]
        auc = [statistics.mean(r["curve"][i]["auc"] for r in runs) for i in range(len(steps))]
        ax.plot(steps, auc, label=f"{name} (lr {best_lr(name):g})", linewidth=1.2)
    ax.set_xlabel("optimizer step (256 samples each)")
    ax.set_ylabel("validation AUC (mean over seeds)")
    ax.set_title(f"{title}, DLRM: validation AUC during training")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
