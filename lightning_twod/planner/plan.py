"""``ShardingPlan``: a plan for every collection of a model, its per-rank report, its printout as a
table and its YAML round trip (so that a plan can be pinned in a config and reused)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_twod.core.mesh import check_group_size
from lightning_twod.core.shards import Shard, ShardingType, TableSharding, parse_sharding_type
from lightning_twod.planner.inputs import GIB, TableSpec
from lightning_twod.planner.load import RankLoad
from lightning_twod.planner.storage import RankStorage


@dataclass(frozen=True)
class RankReport:
    """One shard position of a plan: what it holds and what it is predicted to cost."""

    rank: int
    tables: tuple[str, ...]
    shards: int
    rows: int
    storage: RankStorage
    load: RankLoad

    @property
    def memory(self) -> float:
        return self.storage.total


@dataclass(frozen=True)
class PlanReport:
    """Per shard position: tables, shards, rows, memory, predicted load; and the imbalance."""

    ranks: tuple[RankReport, ...]
    batch_size: int
    links: str  # name of the LinkModel the load was predicted on

    @property
    def imbalance(self) -> float:
        """Predicted load of the busiest rank over the mean (1.0 is perfect balance)."""
        loads = [r.load.total for r in self.ranks]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    @property
    def max_memory(self) -> float:
        return max(r.memory for r in self.ranks)

    @property
    def max_load(self) -> float:
        return max(r.load.total for r in self.ranks)


@dataclass
class ShardingPlan:
    """Sharding of every collection of a model, for a world of ``world_size`` ranks.

    ``modules`` maps each collection's attribute path to ``{table: TableSharding}``; owners are
    positions inside a shard group (``0 .. S - 1``), the same in every group, where ``S`` is the
    table's own ``group_size`` or else ``shard_group_size``.
    ``str(plan)`` prints it as a table; ``to_yaml``/``from_yaml`` round-trip it so it can be pinned
    in a config.
    """

    shard_group_size: int
    world_size: int
    modules: dict[str, dict[str, TableSharding]]
    placement: str = "contiguous"
    ranks_per_node: int | None = None
    report: PlanReport | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_group_size(self.shard_group_size, self.world_size)
        for module, tables in self.modules.items():
            for ts in tables.values():
                check_group_size(ts.size_in(self.shard_group_size), self.world_size, f"table {ts.table!r} of {module!r}")

    def group_sizes(self) -> list[int]:
        """The shard group sizes of the sharded tables, smallest first (one for a global layout)."""
        sizes = {ts.size_in(self.shard_group_size) for tables in self.modules.values() for ts in tables.values()
                 if ts.sharding_type != ShardingType.DATA_PARALLEL}
        return sorted(sizes or {self.shard_group_size})

    @property
    def per_table(self) -> bool:
        """Whether some sharded table has a shard group size other than ``shard_group_size``."""
        return self.group_sizes() != [self.shard_group_size]

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.shard_group_size

    def shardings(self, module: str) -> dict[str, TableSharding]:
        """The ``{table: TableSharding}`` the engine takes for one collection."""
        return dict(self.modules[module])

    # -- YAML
    def to_container(self) -> dict[str, Any]:
        def shard(s: Shard) -> dict[str, Any]:
            return {"owner": s.owner, "rows": [s.row_start, s.row_end], "cols": [s.col_start, s.col_end]}

        def table(ts: TableSharding) -> dict[str, Any]:
            own = {} if ts.group_size is None else {"shard_group_size": ts.group_size}
            return {"name": ts.table, "sharding": ts.sharding_type.value, **own,
                    "shards": [shard(s) for s in ts.shards]}

        return {
            "shard_group_size": self.shard_group_size,
            "world_size": self.world_size,
            "placement": self.placement,
            "ranks_per_node": self.ranks_per_node,
            "modules": [{"path": path, "tables": [table(ts) for ts in tables.values()]}
                        for path, tables in self.modules.items()],
        }

    def to_yaml(self) -> str:
        """YAML that ``from_yaml`` (OmegaConf) reads back; leaf lists inline (``rows: [0, 2500]``)."""
        import yaml  # PyYAML: OmegaConf's own YAML library

        return yaml.safe_dump(self.to_container(), default_flow_style=None, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def from_container(cls, data: Mapping[str, Any]) -> ShardingPlan:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(data, DictConfig):
            data = OmegaConf.to_container(data, resolve=True)
        modules: dict[str, dict[str, TableSharding]] = {}
        for module in data["modules"]:
            tables = {}
            for table in module["tables"]:
                name = table["name"]
                kind = parse_sharding_type(table["sharding"], name)
                shards = tuple(Shard(name, s["rows"][0], s["rows"][1], s["cols"][0], s["cols"][1], s["owner"])
                               for s in table["shards"])
                size = table.get("shard_group_size")
                tables[name] = TableSharding(name, kind, shards, None if size is None else int(size))
            modules[module["path"]] = tables
        return cls(int(data["shard_group_size"]), int(data["world_size"]), modules,
                   data.get("placement", "contiguous"), data.get("ranks_per_node"))

    @classmethod
    def from_yaml(cls, text: str) -> ShardingPlan:
        from omegaconf import OmegaConf

        return cls.from_container(OmegaConf.create(text))

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        return cls.from_yaml(Path(path).read_text())

    # -- checks
    def validate(self, specs_by_module: Mapping[str, Sequence[TableSpec]]) -> None:
        """Raise ``ValueError`` unless the plan shards exactly these tables, every shard in range."""
        missing = [m for m in specs_by_module if m not in self.modules]
        extra = [m for m in self.modules if m not in specs_by_module]
        if missing or extra:
            raise ValueError(f"the plan's collections {list(self.modules)} do not match the model's "
                             f"{list(specs_by_module)}")
        for module, specs in specs_by_module.items():
            plan = self.modules[module]
            if sorted(plan) != sorted(spec.name for spec in specs):
                validate_shardings(specs, plan, self.shard_group_size, module)  # names what differs
            for spec in specs:  # each table in groups of its own size
                validate_shardings([spec], {spec.name: plan[spec.name]}, plan[spec.name].size_in(self.shard_group_size),
                                   module)

    # -- printing
    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        m, s = self.num_replicas, self.shard_group_size
        head = (f"sharding plan: {self.world_size} rank(s) = {m} replica group(s) x {s} rank(s) per shard "
                f"group, placement={self.placement}")
        lines = [head]
        if self.per_table:
            lines[0] = (f"sharding plan: {self.world_size} rank(s), tables in shard groups of their own size "
                        f"{self.group_sizes()} (else {self.shard_group_size}), placement={self.placement}")
        if self.report is None:
            for module, tables in self.modules.items():
                for ts in tables.values():
                    owners = sorted({sh.owner for sh in ts.shards})
                    if ts.sharding_type == ShardingType.DATA_PARALLEL:
                        lines.append(f"  {module}.{ts.table}: data_parallel on every rank")
                        continue
                    size = ts.size_in(self.shard_group_size)
                    copies = self.world_size // size
                    lines.append(f"  {module}.{ts.table}: {ts.sharding_type.value} on {owners} of each group of "
                                 f"{size} ({copies} {'copy' if copies == 1 else 'copies'})")
            return "\n".join(lines)
        rep = self.report
        lines.append(f"  per rank of a shard group (every group is the same), batch {rep.batch_size} per rank, "
                     f"load predicted on links {rep.links}")
        lines.append(f"  {'rank':>4}  {'shards':>6}  {'rows':>14}  {'memory':>10}  {'load ms':>9}  tables")
        for r in rep.ranks:
            tables = ", ".join(r.tables)
            if len(tables) > 60:
                tables = tables[:57] + "..."
            lines.append(f"  {r.rank:>4}  {r.shards:>6}  {r.rows:>14,}  {format_gib(r.memory):>10}  "
                         f"{r.load.total * 1e3:>9.3f}  {tables}")
        loads = [r.load.total for r in rep.ranks]
        mems = [r.memory for r in rep.ranks]
        lines.append(f"  imbalance (max/mean predicted load): {rep.imbalance:.3f}; memory max {format_gib(max(mems))}, "
                     f"mean {format_gib(sum(mems) / len(mems))}; busiest rank {max(loads) * 1e3:.3f} ms")
        return "\n".join(lines)


def format_gib(nbytes: float) -> str:
    """``nbytes`` for people: ``1.50 GiB``, or ``12.00 MiB`` under a tenth of a GiB."""
    if nbytes >= 0.1 * GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def validate_shardings(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                       module: str = "") -> None:
    """Raise ``ValueError`` unless ``plan`` covers every table of ``specs`` exactly once."""
    where = f" of {module!r}" if module else ""
    names = [spec.name for spec in specs]
    if sorted(plan) != sorted(names):
        raise ValueError(f"the plan{where} shards tables {sorted(plan)}, the model has {sorted(names)}")
    for spec in specs:
        ts = plan[spec.name]
        cells = 0
        for sh in ts.shards:
            inside = 0 <= sh.row_start < sh.row_end <= spec.rows and 0 <= sh.col_start < sh.col_end <= spec.dim
            owner_ok = sh.owner == -1 if ts.sharding_type == ShardingType.DATA_PARALLEL else 0 <= sh.owner < group_size
            if not inside or not owner_ok or sh.table != spec.name:
                raise ValueError(f"table {spec.name!r}{where}: shard {sh} does not fit a {spec.rows} x {spec.dim} "
                                 f"table in a shard group of {group_size}")
            cells += sh.rows * sh.dim
        if cells != spec.rows * spec.dim:
            raise ValueError(f"table {spec.name!r}{where}: the shards cover {cells} of {spec.rows * spec.dim} cells")
        if ts.sharding_type == ShardingType.COLUMN_WISE:
            order = [(sh.col_start, sh.owner) for sh in ts.shards]
            if [o for _, o in sorted(order)] != sorted(o for _, o in order) or len({o for _, o in order}) != len(order):
                raise ValueError(f"table {spec.name!r}{where}: column blocks must sit on distinct owners in "
                                 "increasing column order")
