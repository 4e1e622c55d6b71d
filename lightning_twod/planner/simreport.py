"""The simulator's outputs: a text table (with the layout it chose at each size) and a plot."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_twod.planner.memory import MemoryBreakdown, busiest, plan_memory
from lightning_twod.planner.simulate import Scenario, SimPoint, Simulation, reference_world, round_label
from lightning_twod.planner.steptime import StepTime


def describe_scenario(scenario: Scenario) -> str:
    links = scenario.link_model
    a2a = links.all_to_all_intra, links.all_to_all_inter
    fallback = "" if len(scenario.rounds) == 1 else (
        "; or a round with fewer buffers where it is faster or the only one that fits: "
        + ", ".join(round_label(r) for r in scenario.rounds[1:]))
    return (f"scenario {scenario.name}: {len(scenario.tables)} tables, "
            f"{sum(t.rows * t.dim for t in scenario.tables) / 1e9:.2f} B embedding parameters, "
            f"{scenario.batch_size} samples/GPU, {scenario.gpus_per_node} GPUs/node, {scenario.hardware.name} "
            f"({scenario.hardware.memory_bytes / 1e9:.0f} GB); links {links.name}: all-to-all "
            f"{a2a[0].bandwidth / 1e9:.3g} GB/s in a node, {a2a[1].bandwidth / 1e9:.3g} GB/s per GPU across; "
            f"reduction {'overlapped' if scenario.sync_overlap else 'blocking'}, "
            f"{scenario.workload(1).sync_dtype}, every "
            f"{'/'.join(str(k) for k in scenario.sync_intervals)} step(s) (the fastest, a longer one only if "
            f"it saves 2 %{fallback})")


def format_table(scenario: Scenario, simulation: Simulation) -> str:
    """Per world size and layout: the choice (S, M, placement, interval, and the round where the scenario
    allows more than one), memory, phases (ms), step, efficiency."""
    phases = [StepTime.SHORT[p] for p in StepTime.PHASES]
    rounds = len(scenario.rounds) > 1
    lines = [describe_scenario(scenario),
             f"{'GPUs':>5} {'lay':>3} {'S':>5} {'M':>4} {'place':>6} {'k':>3} " + ("  round " if rounds else "")
             + f"{'mem GB':>7} {'imbal':>6} " + " ".join(f"{p:>8}" for p in phases) + f" {'step ms':>8} {'eff':>6}"]
    for p in simulation.points:
        lines.append(_row(p, rounds))
    base = reference_world(simulation.points)
    if base is not None:
        lines.append(f"efficiency = step time of the faster global layout (1D or 2D) at {base} GPUs (the smallest where "
                     "one fits) / step time; PT: every table its own group size (S mixed); OOM: the busiest rank needs more than a GPU's memory; k: reduction interval; "
                     + ("round: ov(erlapped) or bl(ocking), and the wire type; " if rounds else "")
                     + "place: contig(uous) or strided")
    lines += [f"note: {note}" for note in simulation.notes]
    return "\n".join(lines)


def _row(p: SimPoint, rounds: bool) -> str:
    eff = f"{p.efficiency:6.1%}" if p.efficiency is not None else ("   OOM" if not p.fits else "     -")
    place = "contig" if p.placement == "contiguous" else "stride"
    k = "-" if p.layout == "1D" else str(p.interval)
    round_ = "" if not rounds else f"{'-' if p.layout == '1D' else round_label(p.sync_round):>7} "
    times = " ".join(f"{getattr(p.time, phase) * 1e3:>8.2f}" for phase in StepTime.PHASES)
    size, replicas = (str(p.group_size), str(p.replicas)) if not p.candidate.own_sizes else ("mixed", "-")
    imbalance = "     -" if p.imbalance != p.imbalance else f"{p.imbalance:>6.2f}"
    return (f"{p.world_size:>5} {p.layout:>3} {size:>5} {replicas:>4} {place:>6} {k:>3} {round_}"
            f"{p.memory / 1e9:>7.1f} {imbalance} {times} {p.step_time * 1e3:>8.2f} {eff}")


def format_per_table(simulation: Simulation) -> str:
    """Per world size, where the per-table layout put the tables: ``S: tables`` (0: data-parallel)."""
    lines = ["per-table layouts (PT): tables by shard group size (0: data-parallel)"]
    for p in simulation.points:
        if p.layout == "PT" and p.fits:
            where = "; ".join(f"{size}: {', '.join(tables)}" for size, tables in p.tables_by_size().items())
            lines.append(f"{p.world_size:>5} GPUs ({p.tried} assignments searched): {where}")
    return "\n".join(lines)


def point_memory(scenario: Scenario, point: SimPoint) -> MemoryBreakdown:
    """The busiest rank's memory of a simulated layout, by category."""
    plan = point.candidate.plan
    return busiest(plan_memory({"model": list(scenario.tables)}, plan.modules, plan.shard_group_size,
                               plan.num_replicas, scenario.workload(point.interval, point.sync_round),
                               scenario.dense_params))


def format_memory(scenario: Scenario, simulation: Simulation) -> str:
    """Per world size and layout: the busiest rank's GB by category (``memory.MemoryBreakdown``)."""
    names = MemoryBreakdown.categories()
    lines = [f"per-rank memory of the busiest rank (GB), scenario {scenario.name}, {scenario.batch_size} samples/GPU; "
             f"a GPU has {scenario.hardware.memory_bytes / 1e9:.0f} GB, of which the reserve takes "
             f"{(scenario.fixed_memory - scenario.dense_params * 20) / 1e9:.1f}",
             f"{'GPUs':>5} {'lay':>3} {'S':>5} {'M':>4} " + " ".join(f"{MemoryBreakdown.LABELS[n][:10]:>10}" for n in names)
             + f" {'total':>8}"]
    for p in simulation.points:
        if p.candidate.own_sizes:
            continue  # a per-table layout has one breakdown per group size; its total is in the main table
        mem = point_memory(scenario, p)
        lines.append(f"{p.world_size:>5} {p.layout:>3} {p.group_size:>5} {p.replicas:>4} "
                     + " ".join(f"{getattr(mem, n) / 1e9:>10.3f}" for n in names) + f" {mem.total / 1e9:>8.2f}"
                     + ("" if p.fits else "  OOM"))
    return "\n".join(lines)


def plot(scenario: Scenario, simulation: Simulation, path: str) -> str:
    """Write a PNG: scaling efficiency (left) and step-time breakdown (right) of 1D and 2D."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: Sequence[SimPoint] = simulation.points
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for layout, style in (("1D", "o--"), ("2D", "s-"), ("PT", "^:")):
        mine = [p for p in points if p.layout == layout]
        fits = [p for p in mine if p.fits]
        if not mine:
            continue
        left.plot([p.world_size for p in fits], [p.efficiency * 100 for p in fits], style,
                  label="per-table" if layout == "PT" else layout)
        oom = [p.world_size for p in mine if not p.fits]
        if oom:
            left.plot(oom, [0] * len(oom), "x", color="red", markersize=10, label=f"{layout} out of memory")
    left.set_xscale("log", base=2)
    left.set_xlabel("GPUs")
    left.set_ylabel("weak-scaling efficiency (%)")
    left.set_ylim(0, 105)
    left.grid(alpha=0.3)
    left.legend()
    left.set_title(f"{scenario.name}: predicted scaling")
    worlds = sorted({p.world_size for p in points})
    width = 0.38
    colors = plt.get_cmap("tab10").colors
    for k, layout in enumerate(("1D", "2D")):
        mine = {p.world_size: p for p in points if p.layout == layout}
        bottom = [0.0] * len(worlds)
        for j, phase in enumerate(StepTime.PHASES):
            heights = [getattr(mine[w].time, phase) * 1e3 if w in mine else 0.0 for w in worlds]
            xs = [i + (k - 0.5) * width for i in range(len(worlds))]
            right.bar(xs, heights, width, bottom=bottom, color=colors[j], hatch="//" if layout == "1D" else None,
                      label=StepTime.SHORT[phase] if k == 1 else None, edgecolor="white")
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    right.set_xticks(range(len(worlds)), [str(w) for w in worlds])
    right.set_xlabel("GPUs (left bar 1D, hatched; right bar 2D, the layout chosen)")
    right.set_ylabel("predicted step time (ms)")
    right.legend(fontsize=8)
    right.set_title("step-time breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
