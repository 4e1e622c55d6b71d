"""Rank topology of 2D sparse parallelism.

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

:class:`SparseParallelDims` is the pure (process-group free) description of that grid;
:class:`MeshGroups` holds the process groups one rank actually uses.
"""

from __future__ import annotations

from datetime import timedelta

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

# Imported at runtime (not only for type checkers) so that ``typing.get_type_hints`` on the
# dataclasses below works, e.g. for config systems that introspect them.
try:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # torch built without distributed support
    ProcessGroup = Any  # type: ignore[misc,assignment]
    DeviceMesh = Any  # type: ignore[misc,assignment]

Placement = Literal["contiguous", "strided"]

#: Placements accepted by :class:`SparseParallelDims`.
PLACEMENTS: tuple[str, ...] = get_args(Placement)

#: Names of the two dimensions of the device mesh, outer (rows) first.
MESH_DIM_NAMES: tuple[str, str] = ("replicate", "shard")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt_divisors(n: int) -> str:
    return ", ".join(str(d) for d in _divisors(n))


class _MeshCache:
    """``build_mesh`` result on a :class:`SparseParallelDims`, for one default group and device.

    Deep-copies (``copy.deepcopy``, ``dataclasses.asdict``) as None: process groups cannot be
    copied, and a copy simply builds its own mesh when asked.
    """

    __slots__ = ("world", "device_type", "mesh")

    def __init__(self, world: ProcessGroup, device_type: str, mesh: DeviceMesh) -> None:
        self.world = world
        self.device_type = device_type
        self.mesh = mesh

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __repr__(self) -> str:
        return f"_MeshCache(device_type={self.device_type!r}, mesh={self.mesh!r})"


@dataclass(frozen=True)
class SparseParallelDims:
    """Shape of the 2D sparse-parallel grid: ``num_replicas`` x ``shard_group_size`` ranks.

    Pure arithmetic on global ranks; nothing here needs a process group except
    :meth:`build_mesh`. Instances are immutable and hashable (the cached mesh takes no part in
    equality, hashing, ``repr`` or pickling).
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
    #: Mesh cached by :meth:`build_mesh` (with the default group and device type it was built for).
    _mesh_cache: _MeshCache | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        w, s = self.world_size, self.shard_group_size
        if not _is_int(w):
            raise ValueError(f"world_size must be an int, got {w!r} ({type(w).__name__})")
        if w < 1:
            raise ValueError(f"world_size={w} must be >= 1 (the number of ranks)")
        if not _is_int(s):
            raise ValueError(
                f"shard_group_size must be an int, got {s!r} ({type(s).__name__}); "
                f"choose one of {_fmt_divisors(w)} (divisors of world_size={w})"
            )
        if s < 1:
            raise ValueError(
                f"shard_group_size={s} must be >= 1; choose one of {_fmt_divisors(w)} "
                f"(divisors of world_size={w})"
            )
        if w % s != 0:
            raise ValueError(
                f"shard_group_size={s} does not divide world_size={w}; "
                f"choose one of {_fmt_divisors(w)}"
            )
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

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_mesh_cache"] = None  # process groups cannot travel between processes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)

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
    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank={rank!r} is outside [0, {self.world_size}) (world_size={self.world_size})"
            )

    def _rank_at(self, i: int, j: int) -> int:
        """Global rank at row (replica index) ``i``, column (shard index) ``j``."""
        if self.placement == "contiguous":
            return i * self.shard_group_size + j
        return j * self.num_replicas + i

    def mesh_layout(self) -> torch.Tensor:
        """``[M, S]`` int64 global ranks: row i = shard group i, column j = replica group j."""
        ranks = torch.arange(self.world_size, dtype=torch.int64)
        if self.placement == "contiguous":
            return ranks.reshape(self.num_replicas, self.shard_group_size)
        return ranks.reshape(self.shard_group_size, self.num_replicas).t().contiguous()

    def coords(self, rank: int) -> tuple[int, int]:
        """``(i, j)`` of ``rank``: i = replica index (row, i.e. shard group), j = shard index."""
        self._check_rank(rank)
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
        self._check_rank(rank)
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

    # ------------------------------------------------------------------ process groups
    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """2-D ``DeviceMesh`` ``[M, S]``, dims ``("replicate", "shard")``, from :meth:`mesh_layout`.

        Needs an initialized default process group of exactly ``world_size`` ranks. Creating the
        mesh creates its sub-groups (``new_group`` for every row and column), a collective call:
        every rank must call this, in the same order relative to other group creations. The
        mesh is cached on this instance (for the current default group and ``device_type``), so
        later calls are free and return the same object.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"build_mesh() needs an initialized default process group with "
                f"world_size={self.world_size}; call torch.distributed.init_process_group() first"
            )
        actual = dist.get_world_size()
        if actual != self.world_size:
            raise RuntimeError(
                f"default process group has world size {actual} but "
                f"SparseParallelDims.world_size={self.world_size}; they must be equal"
            )
        world = dist.group.WORLD
        cache = self._mesh_cache
        if cache is not None and cache.world is world and cache.device_type == device_type:
            return cache.mesh

        # An arbitrary (e.g. strided) rank layout is accepted as-is: DeviceMesh keeps the
        # flattened tensor as its rank map and a row-major layout over it, so row i / column j
        # of ``mesh_layout()`` become exactly the "shard" / "replicate" sub-groups.
        mesh = DeviceMesh(device_type, self.mesh_layout(), mesh_dim_names=MESH_DIM_NAMES)

        rank = dist.get_rank()
        coordinate = mesh.get_coordinate()
        if coordinate is None or tuple(coordinate) != self.coords(rank):
            raise RuntimeError(
                f"DeviceMesh placed rank {rank} at {coordinate}, expected {self.coords(rank)}"
            )
        object.__setattr__(self, "_mesh_cache", _MeshCache(world, device_type, mesh))
        return mesh


@dataclass
class MeshGroups:
    """Process groups of one rank: world, its shard group (mesh row) and its replica group (mesh column)."""

    #: Grid this rank belongs to.
    dims: SparseParallelDims
    #: Global rank of this process.
    rank: int
    #: Default (world) group; None when world_size == 1 and no process group exists.
    world: ProcessGroup | None
    #: This rank's shard group (mesh row, dim "shard"): all-to-all of embeddings.
    shard: ProcessGroup | None
    #: This rank's replica group (mesh column, dim "replicate"): averaging across copies.
    replica: ProcessGroup | None
    #: The 2-D device mesh the groups come from (None without process groups).
    mesh: DeviceMesh | None

    def __post_init__(self) -> None:
        self.dims._check_rank(self.rank)

    @property
    def shard_rank(self) -> int:
        """Position inside the shard group (which shard of the tables this rank holds)."""
        return self.dims.shard_rank(self.rank)

    @property
    def replica_rank(self) -> int:
        """Position inside the replica group (which copy of the tables this rank belongs to)."""
        return self.dims.replica_rank(self.rank)

    @property
    def shard_ranks(self) -> list[int]:
        """Global ranks of this rank's shard group, ordered by shard index."""
        return self.dims.shard_group(self.rank)

    @property
    def replica_ranks(self) -> list[int]:
        """Global ranks of this rank's replica group, ordered by replica index."""
        return self.dims.replica_group(self.rank)

    @classmethod
    def create(cls, dims: SparseParallelDims, device_type: str = "cpu",
               timeout: timedelta | None = None) -> MeshGroups:
        """Groups of the calling rank, from the initialized default group via ``dims.build_mesh``.

        With ``dims.world_size == 1`` and no initialized process group, returns groups that are
        all None (single process, no collectives). Otherwise this is a collective call (it
        creates the mesh's sub-groups on first use): every rank must call it.
        """
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if not initialized and dims.world_size == 1:
            return cls(dims=dims, rank=0, world=None, shard=None, replica=None, mesh=None)
        mesh = dims.build_mesh(device_type)
        if timeout is not None:
            # DeviceMesh makes its groups with torch's default timeout; a hung peer in an
            # all-to-all or a replica reduction must fail as fast as one in the world group.
            from torch.distributed.distributed_c10d import _set_pg_timeout

            for name in MESH_DIM_NAMES:
                _set_pg_timeout(timeout, mesh.get_group(name))
        return cls(
            dims=dims,
            rank=dist.get_rank(),
            world=dist.group.WORLD,
            shard=mesh.get_group("shard"),
            replica=mesh.get_group("replicate"),
            mesh=mesh,
        )

    def duplicate(self, timeout: timedelta | None = None) -> MeshGroups:
        """New process groups with the same members (world, shard and replica groups), without a mesh.

        Collectives on them are independent of those on ``self``'s groups (a background thread can
        run its own: ``sparse.pipeline``). A collective: every rank must call it. Without process
        groups (one process), returns ``self``.
        """
        import torch.distributed as dist

        if self.world is None:
            return self
        options = {} if timeout is None else {"timeout": timeout}

        def mine(groups: list[list[int]]) -> ProcessGroup:
            own = None
            for ranks in groups:  # every rank creates every group, in the same order
                group = dist.new_group(ranks, **options)
                own = group if self.rank in ranks else own
            return own

        world = mine([list(range(self.dims.world_size))])
        return MeshGroups(self.dims, self.rank, world, mine(self.dims.shard_groups()),
                          mine(self.dims.replica_groups()), mesh=None)

    @classmethod
    def single_process(cls) -> MeshGroups:
        """1 x 1 grid of one rank without any process group."""
        return cls(
            dims=SparseParallelDims(world_size=1, shard_group_size=1),
            rank=0,
            world=None,
            shard=None,
            replica=None,
            mesh=None,
        )


_EXIT_HOOK_REGISTERED = False
_EXIT_SETTLE_SECONDS = 0.1


def destroy_process_groups_at_exit() -> None:
    """Registers, once per process, an exit hook that lets gloo finish before the interpreter does.

    A gloo worker thread drops its reference to a finished collective just after the caller's
    ``wait()`` returns, and dropping the tensors of that work takes the GIL. A script that ends
    right after a collective can reach interpreter finalization first; the thread then aborts the
    process ("terminate called without an active exception") after training finished, its
    launcher reports a failed rank, and under torchrun the other nodes wait in their exit barrier.
    The hook destroys a gloo default group and its sub-groups (which joins gloo's threads when
    nothing else holds a group) and then releases the GIL briefly, so a thread still dropping
    its last work does so while the interpreter is whole.
    """
    global _EXIT_HOOK_REGISTERED
    if _EXIT_HOOK_REGISTERED:
        return
    import atexit
    import time

    import torch.distributed as dist

    def settle() -> None:  # NCCL groups are left to torch's own exit path
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        time.sleep(_EXIT_SETTLE_SECONDS)  # also after a script destroyed the groups itself

    atexit.register(settle)
    _EXIT_HOOK_REGISTERED = True


__all__ = [
    "MESH_DIM_NAMES",
    "PLACEMENTS",
    "MeshGroups",
    "Placement",
    "SparseParallelDims",
    "destroy_process_groups_at_exit",
]
