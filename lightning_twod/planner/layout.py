"""The layout by predicted step time: group size and placement, and ``plan_for_strategy``.

``choose_layout`` plans every candidate layout (group sizes: the divisors of the world size, or
the one given; placements: contiguous and strided, or the one given) with the partitioner, drops
those whose busiest rank does not fit in memory, predicts the step time of the rest on the
``LinkModel`` (``steptime.step_time``: the configured interval, overlap, wire types, batch and
tables), and keeps one of the fastest. Where the links come from repeated probes
(``LinkModel.samples``), each candidate is also predicted on every probe: its ``Outlook``. The
links themselves hold every number at its fastest over the probes (``links.fastest_of``): what
else a host runs only adds time to a probe, so that is the closest to what the links can do, and
every candidate is judged on it. Candidates are taken in order (smaller groups first, contiguous
first); a later one replaces the one chosen so far when it ``beats`` it: faster on every probe and
on the fastest numbers by at least ``MIN_GAIN`` (5 %), or by at least ``MARGIN`` (10 %) on the fastest
numbers. A probe
disturbed on some number (a scheduler slice in a transfer, an overlap share read from two noisy
differences) cannot veto a gain the fastest numbers show: on the two-node testbed, two probes of
three that read the overlap share at 3.6 and 5.0 (the third at 0.6) put the per-table layout 50 %
slower than 1D at the probes' median, where it measures 1.46x faster and the fastest numbers
predict 1.6x. With one set of numbers (a preset, a file without repeats) the fastest wins (ties:
the earlier). Its explanation lists every candidate with its predicted milliseconds per phase, its
range over the probes and memory, says why the choice won over the runner-up, and names the
candidates close to it (neither beats the other).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from lightning_twod.core.mesh import AUTO_GROUP_SIZE, PLACEMENTS, check_group_size, divisors, group_shapes
from lightning_twod.core.shards import ShardingType, TableChoice, TableSharding, parse_table_choice
from lightning_twod.planner.inputs import TableSpec, Workload
from lightning_twod.planner.links import LinkModel, resolve_links
from lightning_twod.planner.memory import reduction_buffers
from lightning_twod.planner.partition import DEFAULT_TOLERANCE, PlanError, plan_model
from lightning_twod.planner.per_table import Assignment, PerTableSearch, describe_tables
from lightning_twod.planner.plan import ShardingPlan, format_gib
from lightning_twod.planner.steptime import DenseModel, StepTime, step_time

#: A candidate replaces the one chosen so far when it is faster on every probe and on their fastest
#: numbers by at least ``MIN_GAIN`` of the chosen one's step, or faster by at least ``MARGIN`` of it
#: on the fastest numbers. Below ``MIN_GAIN`` a gain is inside the model's own error, however
#: steadily the probes show it: on the testbed a per-table layout predicted 2 % faster than groups
#: of 2 on every probe (two tables replicated) took 11-22 % longer a step, measured.
MARGIN = 0.10
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Outlook:
    """A layout's predicted step (s) on the links' fastest numbers (``fast``), and on each of their
    probes (``probes``: empty for one set of numbers)."""

    fast: float
    probes: tuple[float, ...] = ()

    @classmethod
    def of(cls, predict: Callable[[LinkModel], float], links: LinkModel) -> Outlook:
        """``predict`` (links -> seconds) on ``links`` and on each of its probes."""
        return cls(predict(links), tuple(predict(sample) for sample in links.samples))

    @property
    def totals(self) -> tuple[float, ...]:
        return (self.fast, *self.probes)

    def names(self) -> list[str]:
        """What each of ``totals`` was predicted on."""
        return ["the fastest numbers", *(f"probe {i + 1}" for i in range(len(self.probes)))]


def beats(challenger: Outlook, holder: Outlook, margin: float = MARGIN) -> str:
    """Why a layout predicted ``challenger`` replaces one predicted ``holder``, or ``""`` where it does
    not: it is faster on every probe and on their fastest numbers (by at least ``MIN_GAIN`` of ``holder``'s
    step on them where there are probes), or by at least ``margin`` of it on the fastest numbers."""
    gains = [h - c for c, h in zip(challenger.totals, holder.totals)]
    if min(gains) > 0 and (not challenger.probes or _share(challenger.fast, holder.fast) >= MIN_GAIN):
        if not challenger.probes:
            return f"{gains[0] * 1e3:.1f} ms faster"
        low, high = f"{min(gains) * 1e3:.1f}", f"{max(gains) * 1e3:.1f}"
        return (f"faster on all {len(challenger.probes)} probes and their fastest numbers, by "
                f"{low if low == high else f'{low} to {high}'} ms")
    share = _share(challenger.fast, holder.fast)
    if share >= margin:
        return f"{share:.0%} faster on the probes' fastest numbers, at least {margin:.0%}"
    return ""


def short_of(challenger: Outlook, holder: Outlook, margin: float = MARGIN) -> str:
    """Why ``challenger`` does not beat ``holder`` (``beats``): where it is not faster, and by how much
    it is faster (or slower) on the fastest numbers."""
    behind = [name for name, c, h in zip(challenger.names(), challenger.totals, holder.totals) if c >= h]
    return (f"not faster on {', '.join(behind)}; {_signed(_share(challenger.fast, holder.fast))} on the fastest "
            f"numbers, short of {margin:.0%}")


def _share(challenger: float, holder: float) -> float:
    """The share of ``holder``'s step that ``challenger`` saves (negative: it is slower)."""
    return 1 - challenger / holder if holder > 0 else 0.0


def _signed(share: float) -> str:
    return f"{share:.0%} faster" if share >= 0 else f"{-share:.0%} slower"


@dataclass
class Candidate:
    """One layout: its plan and predicted step, or why it does not fit."""

    group_size: int
    placement: str
    plan: ShardingPlan | None = None
    time: StepTime | None = None
    error: str = ""  # why it does not fit, in short (one line of the candidates' list)
    detail: str = ""  # the same with the options to fix it (raised when this was the only layout allowed)
    memory: float = 0.0  # bytes of the busiest rank: the plan's, plus the reduction's buffers
    outlook: Outlook | None = None  # the predicted step on the ends of the links' probes and on each
    own_sizes: dict[str, int] = field(default_factory=dict)  # tables in groups of their own size

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def label(self) -> str:
        own = "".join(f", {table}: {size}" for table, size in self.own_sizes.items())
        return f"S={self.group_size} {self.placement}{own}"

    def describe(self) -> str:
        if not self.fits:
            return f"{self.label}: does not fit ({self.error})"
        probes = ""
        if self.outlook is not None and self.outlook.probes:
            probes = f" (probes {min(self.outlook.totals) * 1e3:.1f}-{max(self.outlook.totals) * 1e3:.1f} ms)"
        return (f"{self.label}: {self.time.total * 1e3:.1f} ms{probes} = {self.time.phases_ms()}; "
                f"busiest rank {format_gib(self.memory)}")


def layout_options(world_size: int, group_size: int | str, placement: str) -> list[tuple[int, str]]:
    """``(group size, placement)`` pairs to compare. A group of 1 or of the whole world is the
    same layout under either placement, so it is listed once (contiguous)."""
    sizes = divisors(world_size) if group_size == AUTO_GROUP_SIZE else [int(group_size)]
    placements = PLACEMENTS if placement == "auto" else (placement,)
    options = []
    for size in sizes:
        for where in placements:
            if where == "strided" and size in (1, world_size) and "contiguous" in placements:
                continue
            options.append((size, where))
    return options


def evaluate_layout(specs_by_module: Mapping[str, Sequence[TableSpec]], world_size: int, group_size: int,
                    placement: str, ranks_per_node: int | None, memory_per_rank: float, workload: Workload,
                    links: LinkModel, dense: DenseModel = DenseModel(), own_sizes: Mapping[str, int] | None = None,
                    **kwargs: Any) -> Candidate:
    """Plan one layout and predict its step (``kwargs``: ``constraints``, ``tolerance``); ``own_sizes``:
    tables in groups of their own size (the others: ``group_size``)."""
    own_sizes = {t: s for t, s in (own_sizes or {}).items() if s != group_size}
    if own_sizes:
        search = PerTableSearch(specs_by_module, world_size, placement, ranks_per_node, memory_per_rank, workload,
                                links, dense, **kwargs)
        chosen = search.evaluate({t: own_sizes.get(t, group_size) for t in search.tables}, default=group_size)
        return from_assignment(chosen, group_size, placement, search)
    candidate = Candidate(group_size, placement)
    try:
        candidate.plan = plan_model(specs_by_module, world_size, group_size, workload, memory_per_rank=memory_per_rank,
                                    placement=placement, ranks_per_node=ranks_per_node, links=links, **kwargs)
    except PlanError as err:
        candidate.detail = str(err)
        candidate.error = candidate.detail.split(". Options")[0].split(": its finest cut")[0]
        return candidate
    plan = candidate.plan
    buffers = [0.0] * group_size
    for module, specs in specs_by_module.items():
        for p, extra in enumerate(reduction_buffers(specs, plan.modules[module], group_size, plan.num_replicas,
                                                    workload)):
            buffers[p] += extra
    candidate.memory = max(r.memory + b for r, b in zip(plan.report.ranks, buffers, strict=True))
    if candidate.memory > memory_per_rank:
        candidate.plan = None
        candidate.error = (f"the busiest rank needs {format_gib(candidate.memory)} with the reduction's buffers "
                           f"({format_gib(max(buffers))}: {_buffer_kind(workload)}), a rank has {format_gib(memory_per_rank)}")
        candidate.detail = (f"{candidate.label}: {candidate.error}. Options: a larger shard_group_size, "
                            "sync_dtype='fp32' with sync_overlap=False (no reference copy or snapshot), or more "
                            "memory per rank (memory_per_rank_gb)")
        return candidate
    def predict(on: LinkModel) -> StepTime:
        return step_time(specs_by_module, candidate.plan.modules, world_size, group_size, placement,
                         ranks_per_node, workload, on, dense)

    candidate.time = predict(links)
    candidate.outlook = Outlook.of(lambda on: predict(on).total, links)
    return candidate


def from_assignment(chosen: Assignment, group_size: int, placement: str, search: PerTableSearch) -> Candidate:
    """A per-table assignment as a candidate layout (its ``own_sizes``: the tables not at ``group_size``)."""
    own = {t: s for t, s in chosen.sizes.items() if s != group_size}
    if not chosen.fits:
        failed = Candidate(group_size, placement, error=chosen.error, own_sizes=own)
        failed.detail = (f"{failed.label}: {chosen.error}. Options: other shard group sizes for the tables named, "
                         "row_wise sharding, or more memory per rank (memory_per_rank_gb)")
        return failed
    own = {t: ts.group_size for tables in chosen.plan.modules.values() for t, ts in tables.items()
           if ts.group_size is not None}
    return Candidate(chosen.plan.shard_group_size, placement, chosen.plan, chosen.time, memory=chosen.memory,
                     outlook=Outlook.of(lambda on: search.total_on(chosen, on), search.links), own_sizes=own)


def _buffer_kind(workload: Workload) -> str:
    if workload.sync_dtype == "int8":
        return "int8 reference and residual copies, and the changes"
    if workload.sync_dtype == "bf16":
        return "bf16 reference copy" + (" and overlap snapshot" if workload.sync_overlap else "")
    return "overlap snapshot" if workload.sync_overlap else "gathered rows"


def choose_layout(specs_by_module: Mapping[str, Sequence[TableSpec]], world_size: int, ranks_per_node: int | None,
                  memory_per_rank: float, workload: Workload | None = None, links: LinkModel | str | None = None,
                  dense: DenseModel = DenseModel(), group_size: int | str = AUTO_GROUP_SIZE, placement: str = "auto",
                  own_sizes: Mapping[str, int] | None = None, **kwargs: Any
                  ) -> tuple[Candidate, list[Candidate], str]:
    """The fastest layout that fits, every candidate, and the explanation (see the module docstring).
    ``own_sizes``: tables that keep their own group size in every candidate."""
    workload, links = workload or Workload(), resolve_links(links)
    candidates = [evaluate_layout(specs_by_module, world_size, size, where, ranks_per_node, memory_per_rank,
                                  workload, links, dense, own_sizes, **kwargs)
                  for size, where in layout_options(world_size, group_size, placement)]
    fitting = [c for c in candidates if c.fits]
    if not fitting and len(candidates) == 1:  # a pinned layout: its own error, with the options
        raise PlanError(candidates[0].detail)
    if not fitting:
        tried = "; ".join(f"{c.label}: {c.error}" for c in candidates)
        raise PlanError(f"no layout of {world_size} ranks fits the memory ({tried}). Options: more ranks, row_wise "
                        "or column_wise sharding, smaller embedding dims, a smaller batch, or more memory per rank")
    best = fitting[0]
    for challenger in fitting[1:]:
        if beats(challenger.outlook, best.outlook):
            best = challenger
    return best, candidates, explain(best, candidates, memory_per_rank, links, workload)


def explain(best: Candidate, candidates: Sequence[Candidate], memory_per_rank: float, links: LinkModel,
            workload: Workload, why: str | None = None) -> str:
    """The chosen layout and why (first line), then one line per candidate."""
    plan = best.plan
    s, m = plan.shard_group_size, plan.num_replicas
    others = sorted((c for c in candidates if c.fits and c is not best), key=lambda c: c.time.total)
    if why is None:
        why = "as configured" if len(candidates) == 1 else _why(best, others[0]) if others else "the only layout that fits"
    budget = "unlimited" if math.isinf(memory_per_rank) else format_gib(memory_per_rank)
    mode = (f"sync every {workload.sync_interval} step(s), {'overlapped' if workload.sync_overlap else 'blocking'}, "
            f"{workload.sync_dtype} reduction")
    if workload.sync_mode == "gradients":
        mode = "touched rows' gradients averaged every step"
    head = (f"shard_group_size={s}, placement={plan.placement} ({m} replica group(s) x {s} rank(s)): {why}; "
            f"predicted {best.time.total * 1e3:.1f} ms per step ({mode}); busiest rank needs "
            f"{format_gib(best.memory)} of {budget}{_where(plan)}{_imbalance(plan)}; "
            f"links: {links.name} ({links.source})")
    if best.own_sizes:
        head += "; tables in groups of their own size: " + ", ".join(f"{t}: {s}" for t, s in best.own_sizes.items())
    if len(candidates) == 1:
        return head
    lines = [head, "  candidates (predicted ms per step by phase, the range over the links' probes; busiest rank's "
                   "memory):"]
    lines += [f"  {'*' if c is best else ' '} {c.describe()}" for c in candidates]
    close = [c for c in others if not beats(best.outlook, c.outlook) and not beats(c.outlook, best.outlook)]
    if close:
        lines.append(f"  close to the choice (neither is faster on every probe, nor by {MARGIN:.0%} on their fastest numbers): "
                     + "; ".join(f"{c.label}: {short_of(c.outlook, best.outlook)}" for c in close))
    return "\n".join(lines)


def _imbalance(plan: ShardingPlan) -> str:
    """The predicted imbalance of a plan's shard positions (a per-table plan has one per group size: none)."""
    return "" if plan.report is None else f"; predicted imbalance {plan.report.imbalance:.2f}"


def _why(best: Candidate, runner_up: Candidate) -> str:
    """Why ``best`` was chosen over ``runner_up`` (the other candidate predicted fastest): the phases it
    saves and how it beats it on the links' probes, or why ``runner_up``, predicted faster, does not."""
    gain = runner_up.time.total - best.time.total
    if gain < 0:
        return (f"kept: {runner_up.label} is predicted {-gain * 1e3:.1f} ms ({-gain / best.time.total:.0%}) "
                f"faster, but {short_of(runner_up.outlook, best.outlook)}")
    deltas = {p: getattr(runner_up.time, p) - getattr(best.time, p) for p in StepTime.PHASES}
    saved = max(deltas, key=deltas.get)
    text = (f"the lowest predicted step time, {gain * 1e3:.1f} ms ({gain / runner_up.time.total:.0%}) below "
            f"{runner_up.label}: {deltas[saved] * 1e3:.1f} ms less {StepTime.SHORT[saved]}")
    paid = min(deltas, key=deltas.get)
    if deltas[paid] < 0:
        text += f" for {-deltas[paid] * 1e3:.1f} ms more {StepTime.SHORT[paid]}"
    reason = beats(best.outlook, runner_up.outlook)
    if best.outlook.probes:
        text += f"; {reason}" if reason else f"; close to it ({short_of(best.outlook, runner_up.outlook)})"
    return text


def _where(plan: ShardingPlan) -> str:
    rpn = plan.ranks_per_node
    if not rpn or rpn >= plan.world_size:
        return ""
    shard, replica, _ = group_shapes(plan.world_size, plan.shard_group_size, plan.placement, rpn)
    inside = "inside one node" if not shard.spans_nodes else f"across {math.ceil(shard.size / shard.local)} nodes"
    cross = "inside one node" if not replica.spans_nodes else "across nodes"
    return f"; shard groups {inside}, replica groups {cross} ({rpn} ranks per node)"


class StrategyPlan(NamedTuple):
    """What ``plan_for_strategy`` returns: unpacks to ``(group_size, plans, explanation, plan)``."""

    group_size: int
    plans: dict[str, dict[str, TableSharding]]
    explanation: str
    plan: ShardingPlan


def specs_from_configs(tables_by_module: Mapping[str, Sequence[Any]],
                       stats: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, list[TableSpec]]:
    """``{module: [EmbeddingTableConfig | (name, rows, dim) | TableSpec]}`` -> ``TableSpec``s.

    ``stats`` (table -> ``{"pooling_factor": .., "weighted": .., "id_skew": ..}``) adds lookup
    statistics; by default a feature has one id per sample, uniform over the rows.
    """
    stats = stats or {}
    out: dict[str, list[TableSpec]] = {}
    for module, tables in tables_by_module.items():
        specs = []
        for table in tables:
            if isinstance(table, TableSpec):
                specs.append(table)
                continue
            if isinstance(table, tuple):
                name, rows, dim = table[:3]
                spec = TableSpec(name, rows, dim)
            else:
                spec = TableSpec.from_config(table)
            extra = dict(stats.get(spec.name, {}))
            specs.append(replace(spec, **extra) if extra else spec)
        out[module] = specs
    return out


@dataclass(frozen=True)
class PlanRequest:
    """What ``plan_for_strategy`` plans for: the world, one training step, the layout asked for.

    ``memory_per_rank_bytes``: what a rank may hold; ``workload``: the step the layouts are
    predicted on (batch, optimizer, wire types, reduction); ``shard_group_size`` (an int or
    ``"auto"``) and ``placement`` (``"contiguous"``, ``"strided"`` or ``"auto"``): the layouts
    ``choose_layout`` compares; ``constraints``: the ``sharding`` entries (per table a type, its own
    group size, or both: a ``TableChoice`` or what ``parse_table_choice`` reads); ``stats``: lookup
    statistics per table (``specs_from_configs``); ``pinned``: a ``ShardingPlan`` (or the path of
    its YAML) to use instead of planning; ``links``: what step times are predicted on
    (``resolve_links``); ``dense``: the dense part; ``tolerance``: the partitioner's.
    """

    world_size: int
    ranks_per_node: int | None
    memory_per_rank_bytes: float
    workload: Workload = Workload()
    shard_group_size: int | str = AUTO_GROUP_SIZE
    placement: str = "contiguous"
    constraints: Mapping[str, str | TableChoice] | None = None
    stats: Mapping[str, Mapping[str, Any]] | None = None
    pinned: ShardingPlan | str | Path | None = None
    links: LinkModel | str | None = None
    dense: DenseModel = DenseModel()
    tolerance: float = DEFAULT_TOLERANCE


def plan_for_strategy(tables_by_module: Mapping[str, Sequence[Any]], request: PlanRequest) -> StrategyPlan:
    """Everything ``TwoDSparseStrategy`` needs: group size, per-collection plans, the explanation.

    ``tables_by_module``: ``{module path: [EmbeddingTableConfig | (name, rows, dim) | TableSpec]}``.
    Without ``request.pinned``, ``choose_layout`` among the layouts the request allows, then, with
    ``shard_group_size="auto"``, ``per_table.PerTableSearch`` from its choice: each table its own group
    size where that assignment ``beats`` the global layout on the links' probes. A pinned plan is checked
    against the tables, the world size and an explicit group size or placement.
    """
    specs = specs_from_configs(tables_by_module, request.stats)
    links = resolve_links(request.links)
    check_known_tables(specs, request.constraints or {})
    types, own_sizes = split_choices(request.constraints or {}, request.world_size)
    if request.pinned is None:
        best, candidates, line = choose_layout(
            specs, request.world_size, request.ranks_per_node, request.memory_per_rank_bytes, request.workload, links,
            request.dense, group_size=request.shard_group_size, placement=request.placement, own_sizes=own_sizes,
            constraints=types, tolerance=request.tolerance)
        if request.shard_group_size != AUTO_GROUP_SIZE:
            return _strategy_plan(best.plan, line)
        return _per_table(specs, request, links, types, own_sizes, best, candidates)
    plan = request.pinned if isinstance(request.pinned, ShardingPlan) else ShardingPlan.load(request.pinned)
    if plan.world_size != request.world_size:
        raise ValueError(f"the pinned plan is for world_size={plan.world_size}, this run has {request.world_size}")
    if request.shard_group_size not in (AUTO_GROUP_SIZE, plan.shard_group_size):
        raise ValueError(f"shard_group_size={request.shard_group_size} but the pinned plan has "
                         f"{plan.shard_group_size}; drop one of them")
    if request.placement not in ("auto", plan.placement):
        raise ValueError(f"placement={request.placement!r} but the pinned plan has {plan.placement!r}; drop one of them")
    plan.validate(specs)
    size, where, workload = plan.shard_group_size, plan.placement, request.workload
    search = PerTableSearch(specs, request.world_size, where, request.ranks_per_node, request.memory_per_rank_bytes,
                            workload, links, request.dense)
    known = search.predict(plan)
    if not plan.per_table:
        plan.report = known.parts[0].plan.report
    own = {t: ts.group_size for tables in plan.modules.values() for t, ts in tables.items() if ts.group_size}
    pinned = Candidate(size, where, plan, known.time, memory=known.memory, own_sizes=own)
    return _strategy_plan(plan, explain(pinned, [pinned], request.memory_per_rank_bytes, links, workload,
                                        why="from the pinned plan"))


def check_known_tables(specs_by_module: Mapping[str, Sequence[TableSpec]], constraints: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the tables of ``constraints`` (the ``sharding`` entries) that
    ``specs_by_module`` (``specs_from_configs``) does not hold, and the tables it holds."""
    known = {spec.name for module_specs in specs_by_module.values() for spec in module_specs}
    unknown = sorted(set(constraints) - known)
    if unknown:
        raise ValueError(f"sharding names unknown tables {unknown}; the model's tables are {sorted(known)}")


def split_choices(choices: Mapping[str, str | TableChoice], world_size: int) -> tuple[dict[str, str], dict[str, int]]:
    """``sharding`` entries -> (sharding type per table, own group size per table); raises ``ValueError``
    naming the table and the sizes a world of ``world_size`` allows when a size does not divide it."""
    types, sizes = {}, {}
    for table, choice in choices.items():
        choice = choice if isinstance(choice, TableChoice) else parse_table_choice(choice, table)
        if choice.sharding_type is not None:
            types[table] = choice.sharding_type.value
        if choice.group_size is not None and choice.sharding_type != ShardingType.DATA_PARALLEL:
            check_group_size(choice.group_size, world_size, f"table {table!r}")
            sizes[table] = choice.group_size
    return types, sizes


def _per_table(specs, request: PlanRequest, links: LinkModel, types: dict[str, str], own_sizes: dict[str, int],
               best: Candidate, candidates: list[Candidate]) -> StrategyPlan:
    """From the global layout ``best``, each table its own group size where predicted faster (``per_table``);
    where table names repeat across collections, the global layout as it is (the log says why)."""
    names = [spec.name for module_specs in specs.values() for spec in module_specs]
    if len(set(names)) < len(names):
        return _strategy_plan(best.plan, explain(best, candidates, request.memory_per_rank_bytes, links,
                                                 request.workload) + "\n  per table: not searched (table names "
                              "repeat across collections; per-table group sizes name tables by their names)")
    search = PerTableSearch(specs, request.world_size, best.placement, request.ranks_per_node,
                            request.memory_per_rank_bytes, request.workload, links, request.dense, constraints=types,
                            tolerance=request.tolerance)
    data_parallel = {t for t, kind in types.items() if kind == ShardingType.DATA_PARALLEL.value}
    start = {t: own_sizes.get(t, best.group_size) for t in search.tables}
    found = search.search(start, {**{t: start[t] for t in data_parallel}, **own_sizes})
    moved = found.fits and found.sizes != start
    chosen = from_assignment(found, best.group_size, best.placement, search) if moved else best
    kept, reason = "", beats(chosen.outlook, best.outlook) if chosen is not best else ""
    if chosen is not best and not reason:
        # not clearly faster on the links' probes: the global layout stays, and the log says so
        kept = (f"\n  per table: the best assignment found, {chosen.label}, predicts {chosen.time.total * 1e3:.1f} ms, "
                f"{(best.time.total - chosen.time.total) * 1e3:.1f} ms below {best.label}, but is "
                f"{short_of(chosen.outlook, best.outlook)}: the global layout stays (`lightning-twod calibrate` "
                "measures the links longer, for steadier numbers)")
        chosen = best
    if chosen is best:
        found = search.evaluate(start, default=best.group_size)
    why = (f"each table its own group size, {(best.time.total - chosen.time.total) * 1e3:.1f} ms below the best "
           f"global layout {best.label}" + (f": {reason}" if chosen.outlook.probes else "")
           if chosen is not best else None)
    text = explain(chosen, [chosen, *candidates] if chosen is not best else candidates,
                   request.memory_per_rank_bytes, links, request.workload, why=why) + kept
    if found.fits:
        text += (f"\n  per table (searched {search.evaluations} assignments, "
                 f"{'every one' if search.exact else 'greedily'}):\n" + "\n".join(describe_tables(search, found)))
    return _strategy_plan(chosen.plan, text)


def _strategy_plan(plan: ShardingPlan, explanation: str) -> StrategyPlan:
    return StrategyPlan(plan.shard_group_size, {m: plan.shardings(m) for m in plan.modules}, explanation, plan)
