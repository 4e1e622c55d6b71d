"""The 2D grid of ranks as arithmetic: which ranks form which groups, on which nodes (no process group).

``W`` ranks form a grid of ``M`` replicas x ``S`` shards, where ``S = shard_group_size`` and
``M = W // S``:

* a **shard group** (one mesh row) holds one complete copy of the embedding tables, sharded
  across its ``S`` ranks; the embedding all-to-all runs only inside it;
* a **replica group** (one mesh column) holds the ``M`` ranks that own the same shard in every
  copy; their shard weights / gradients / optimizer state are averaged across it.

The mesh layout is an ``[M, S]`` tensor of global ranks (row ``i`` = shard group ``i``, column
``j`` = replica group ``j``) with mesh dim names ``("replicate", "shard")``. Two placements map
global ranks onto that grid. For ``W = 8, S = 4`` (so ``M = 2``):

``placement="contiguous"`` (default): a shard group is ``S`` consecutive ranks -- one node when
``S`` equals the ranks per node, so the all-to-all stays on the intra-node links and only the
(less frequent) replica averaging crosses nodes::

                   shard index j ->
                    0    1    2    3
                 +----+----+----+----+
    replica  i=0 |  0 |  1 |  2 |  3 |   shard group 0 = [0, 1, 2, 3]   (node 0)
    index    i=1 |  4 |  5 |  6 |  7 |   shard group 1 = [4, 5, 6, 7]   (node 1)
                 +----+----+----+----+
                   replica groups: [0, 4]  [1, 5]  [2, 6]  [3, 7]

``placement="strided"`` (TorchRec's default for its 2D parallel): a replica group is ``M``
consecutive ranks, so replicas of a shard sit on the same node and a shard group strides over
the nodes::

                   shard index j ->
                    0    1    2    3
                 +----+----+----+----+
    replica  i=0 |  0 |  2 |  4 |  6 |   shard group 0 = [0, 2, 4, 6]
    index    i=1 |  1 |  3 |  5 |  7 |   shard group 1 = [1, 3, 5, 7]
                 +----+----+----+----+
                   replica groups: [0, 1]  [2, 3]  [4, 5]  [6, 7]

Either way the rank at row ``i``, column ``j`` is ``i * replica_stride + j * shard_stride``
(``group_strides``): the one placement rule, used by :class:`SparseParallelDims` and by the
planner's ``group_shapes``. Nothing here needs a process group or imports torch at module level,
so the planner imports it without torch; ``lightning_twod.distributed.groups`` builds the
``DeviceMesh`` and the process groups one rank uses (``MeshGroups``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch

Placement = Literal["contiguous", "strided"]

#: Placements accepted by :class:`SparseParallelDims`.
PLACEMENTS: tuple[str, ...] = get_args(Placement)

#: ``shard_group_size`` left to the planner: the group size of the lowest predicted step time.
AUTO_GROUP_SIZE = "auto"

#: Names of the two dimensions of the device mesh, outer (rows) first.
MESH_DIM_NAMES: tuple[str, str] = ("replicate", "shard")


def group_strides(placement: str, world_size: int, shard_group_size: int) -> tuple[int, int]:
    """``(shard_stride, replica_stride)``: the rank distance between neighbours of a shard group
    (one mesh row) and of a replica group (one mesh column). Contiguous: ``(1, S)``; strided: ``(M, 1)``."""
    if placement == "contiguous":
        return 1, shard_group_size
    return world_size // shard_group_size, 1


def members_per_node(group_size: int, stride: int, ranks_per_node: int) -> int:
    """Members of a group of ``group_size`` ranks spaced ``stride`` apart that share a node."""
    if stride >= ranks_per_node:
        return 1
    return max(1, min(group_size, ranks_per_node // stride))


@dataclass(frozen=True)
class GroupShape:
    """A kind of process group of a layout: ``size`` members, ``local`` of them on each node."""

    size: int
    local: int

    @property
    def spans_nodes(self) -> bool:
        return self.size > self.local


def group_shapes(world: int, group_size: int, placement: str, ranks_per_node: int | None
                 ) -> tuple[GroupShape, GroupShape, GroupShape]:
    """Shard group, replica group and world of a layout (``ranks_per_node`` None: one node)."""
    rpn = ranks_per_node or world
    shard_stride, replica_stride = group_strides(placement, world, group_size)
    replicas = world // group_size
    return (GroupShape(group_size, members_per_node(group_size, shard_stride, rpn)),
            GroupShape(replicas, members_per_node(replicas, replica_stride, rpn)),
            GroupShape(world, min(world, rpn)))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``: the shard group sizes a world of ``n`` ranks allows."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt_divisors(n: int) -> str:
    return ", ".join(str(d) for d in divisors(n))


def check_group_size(size: Any, world_size: int, table: str | None = None) -> None:
    """Raise ``ValueError`` unless ``size`` is a shard group size of a world of ``world_size`` ranks (an
    int >= 1 that divides it), naming ``table`` (a label such as ``"table 'item'"``; None: the global
    ``shard_group_size``) and the sizes the world allows."""
    w, s = world_size, size
    prefix = "" if table is None else f"{table}: "
    if not _is_int(s):
        raise ValueError(
            f"{prefix}shard_group_size must be an int, got {s!r} ({type(s).__name__}); "
            f"choose one of {_fmt_divisors(w)} (divisors of world_size={w})"
        )
    if s < 1:
        raise ValueError(
            f"{prefix}shard_group_size={s} must be >= 1; choose one of {_fmt_divisors(w)} "
            f"(divisors of world_size={w})"
        )
    if w % s != 0:
        raise ValueError(
            f"{prefix}shard_group_size={s} does not divide world_size={w}; "
            f"choose one of {_fmt_divisors(w)}"
        )


@dataclass(frozen=True)
class SparseParallelDims:
    """Shape of the 2D sparse-parallel grid: ``num_replicas`` x ``shard_group_size`` ranks.

    Pure arithmetic on global ranks; nothing here needs a process group
    (``distributed.groups.build_mesh`` makes its ``DeviceMesh``). Instances are immutable and hashable.
    """

    #: Total number of ranks ``W`` (the default process group's world size).
    world_size: int
    #: ``S``: ranks holding one complete, sharded copy of the tables (one mesh row). Must divide
    #: ``world_size``; ``S == world_size`` is plain 1D sharding, ``S == 1`` pure replication.
    shard_group_size: int
    #: How global ranks map onto the grid: ``"contiguous"`` (shard group = consecutive ranks) or
    #: ``"strided"`` (replica group = consecutive ranks). See the module docstring.
    placement: str = "contiguous"
    #: Ranks per node, optional. Only used for locality reporting (:meth:`node_of`,
    #: :meth:`locality`, :meth:`describe`): which groups cross node boundaries.
    ranks_per_node: int | None = None
    def __post_init__(self) -> None:
        w, s = self.world_size, self.shard_group_size
        if not _is_int(w):
            raise ValueError(f"world_size must be an int, got {w!r} ({type(w).__name__})")
        if w < 1:
            raise ValueError(f"world_size={w} must be >= 1 (the number of ranks)")
        check_group_size(s, w)
        if self.placement not in PLACEMENTS:
            allowed = " or ".join(repr(p) for p in PLACEMENTS)
            raise ValueError(f"placement={self.placement!r} is not supported; use {allowed}")
        r = self.ranks_per_node
        if r is not None:
            if not _is_int(r):
                raise ValueError(
                    f"ranks_per_node must be an int or None, got {r!r} ({type(r).__name__})"
                )
            if r < 1:
                raise ValueError(f"ranks_per_node={r} must be >= 1 (or None if unknown)")
            if w % r != 0:
                raise ValueError(
                    f"ranks_per_node={r} does not divide world_size={w}; "
                    f"choose one of {_fmt_divisors(w)} (or None if unknown)"
                )

    # ------------------------------------------------------------------ shape
    @property
    def num_replicas(self) -> int:
        """``M = world_size // shard_group_size``: number of complete copies of the tables."""
        return self.world_size // self.shard_group_size

    @property
    def is_1d(self) -> bool:
        """One shard group spans all ranks (``M == 1``): plain 1D sharding, no replica averaging."""
        return self.num_replicas == 1

    @property
    def is_trivial(self) -> bool:
        """A single rank (``world_size == 1``)."""
        return self.world_size == 1

    # ------------------------------------------------------------------ rank arithmetic
    def check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank={rank!r} is outside [0, {self.world_size}) (world_size={self.world_size})"
            )

    def _rank_at(self, i: int, j: int) -> int:
        """Global rank at row (replica index) ``i``, column (shard index) ``j``."""
        shard_stride, replica_stride = group_strides(self.placement, self.world_size, self.shard_group_size)
        return i * replica_stride + j * shard_stride

    def mesh_layout(self) -> torch.Tensor:
        """``[M, S]`` int64 global ranks: row i = shard group i, column j = replica group j."""
        import torch

        return torch.tensor(self.shard_groups(), dtype=torch.int64)

    def coords(self, rank: int) -> tuple[int, int]:
        """``(i, j)`` of ``rank``: i = replica index (row, i.e. shard group), j = shard index."""
        self.check_rank(rank)
        if self.placement == "contiguous":
            return divmod(rank, self.shard_group_size)
        j, i = divmod(rank, self.num_replicas)
        return i, j

    def shard_rank(self, rank: int) -> int:
        """Position of ``rank`` inside its shard group (= which shard of the tables it holds)."""
        return self.coords(rank)[1]

    def replica_rank(self, rank: int) -> int:
        """Position of ``rank`` inside its replica group (= which copy of the tables it is in)."""
        return self.coords(rank)[0]

    def shard_group(self, rank: int) -> list[int]:
        """Global ranks of the shard group (mesh row) containing ``rank``, by shard index."""
        i, _ = self.coords(rank)
        return [self._rank_at(i, j) for j in range(self.shard_group_size)]

    def replica_group(self, rank: int) -> list[int]:
        """Global ranks of the replica group (mesh column) containing ``rank``, by replica index."""
        _, j = self.coords(rank)
        return [self._rank_at(i, j) for i in range(self.num_replicas)]

    def shard_groups(self) -> list[list[int]]:
        """All ``M`` shard groups (mesh rows), ordered by replica index i."""
        return [
            [self._rank_at(i, j) for j in range(self.shard_group_size)]
            for i in range(self.num_replicas)
        ]

    def replica_groups(self) -> list[list[int]]:
        """All ``S`` replica groups (mesh columns), ordered by shard index j."""
        return [
            [self._rank_at(i, j) for i in range(self.num_replicas)]
            for j in range(self.shard_group_size)
        ]

    # ------------------------------------------------------------------ locality
    def node_of(self, rank: int) -> int:
        """Node index of ``rank`` (``rank // ranks_per_node``); needs ``ranks_per_node``."""
        if self.ranks_per_node is None:
            raise ValueError(
                "node_of() needs ranks_per_node; pass SparseParallelDims(..., ranks_per_node=N)"
            )
        self.check_rank(rank)
        return rank // self.ranks_per_node

    def _nodes(self, group: list[int]) -> list[int]:
        return sorted({self.node_of(r) for r in group})

    def locality(self) -> dict[str, Any]:
        """Which links the groups cross; needs ``ranks_per_node``.

        Returns a dict with

        * ``ranks_per_node``, ``num_nodes``;
        * ``shard_groups_intra_node``: every shard group lies inside one node (all-to-all stays
          on intra-node links);
        * ``replica_groups_intra_node``: every replica group lies inside one node;
        * ``shard_group_max_nodes`` / ``replica_group_max_nodes``: the most nodes any one group
          of that kind spans.
        """
        if self.ranks_per_node is None:
            raise ValueError(
                "locality() needs ranks_per_node; pass SparseParallelDims(..., ranks_per_node=N)"
            )
        shard_span = max(len(self._nodes(g)) for g in self.shard_groups())
        replica_span = max(len(self._nodes(g)) for g in self.replica_groups())
        return {
            "ranks_per_node": self.ranks_per_node,
            "num_nodes": self.world_size // self.ranks_per_node,
            "shard_groups_intra_node": shard_span == 1,
            "replica_groups_intra_node": replica_span == 1,
            "shard_group_max_nodes": shard_span,
            "replica_group_max_nodes": replica_span,
        }

    def describe(self) -> str:
        """Readable table of the mesh: one line per shard group and one per replica group."""
        m, s = self.num_replicas, self.shard_group_size
        header = (
            f"2D sparse mesh: world_size={self.world_size} = {m} replica(s) x {s} shard(s), "
            f"placement={self.placement}"
        )
        if self.ranks_per_node is not None:
            header += f", ranks_per_node={self.ranks_per_node}"

        def node_note(group: list[int]) -> str:
            if self.ranks_per_node is None:
                return ""
            nodes = self._nodes(group)
            label = "node" if len(nodes) == 1 else "nodes"
            return f"  ({label} {', '.join(map(str, nodes))})"

        width_i = len(str(max(m, s) - 1))
        lines = [header]
        for i, group in enumerate(self.shard_groups()):
            row = f"{i:>{width_i}} (row {i:>{width_i}}):   "
            lines.append(f"  shard group   {row} {group}{node_note(group)}")
        for j, group in enumerate(self.replica_groups()):
            col = f"{j:>{width_i}} (column {j:>{width_i}}):"
            lines.append(f"  replica group {col} {group}{node_note(group)}")
        if self.ranks_per_node is not None:
            loc = self.locality()
            lines.append(
                f"  shard groups intra-node: {loc['shard_groups_intra_node']}, "
                f"replica groups intra-node: {loc['replica_groups_intra_node']}"
            )
        return "\n".join(lines)
