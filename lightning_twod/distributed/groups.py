"""Process groups: whether this process has any, and the groups of the mesh one rank uses (``MeshGroups``).

The grid's arithmetic (which ranks form which group) is ``lightning_twod.core.mesh.SparseParallelDims``;
here it becomes process groups, through the 2-D ``DeviceMesh`` it builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_twod.core.mesh import MESH_DIM_NAMES, SparseParallelDims

# Imported at runtime (not only for type checkers) so that ``typing.get_type_hints`` on the
# dataclass below works, e.g. for config systems that introspect it.
try:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # torch built without distributed support
    ProcessGroup = Any  # type: ignore[misc,assignment]
    DeviceMesh = Any  # type: ignore[misc,assignment]


def has_process_group() -> bool:
    """Whether this process has a default process group (torch.distributed built in and initialized)."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` (or no process group left, e.g. after teardown) means one process."""
    return 1 if group is None or not has_process_group() else dist.get_world_size(group)


def build_mesh(dims: SparseParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """2-D ``DeviceMesh`` ``[M, S]``, dims ``("replicate", "shard")``, from ``dims.mesh_layout()``.

    Needs an initialized default process group of exactly ``dims.world_size`` ranks. Creating the
    mesh creates its sub-groups (``new_group`` for every row and column), a collective call: every
    rank must call this, in the same order relative to other group creations (``MeshGroups.create``
    does, once, and keeps the mesh).
    """
    if not has_process_group():
        raise RuntimeError(
            f"build_mesh() needs an initialized default process group with "
            f"world_size={dims.world_size}; call torch.distributed.init_process_group() first"
        )
    actual = dist.get_world_size()
    if actual != dims.world_size:
        raise RuntimeError(
            f"default process group has world size {actual} but "
            f"SparseParallelDims.world_size={dims.world_size}; they must be equal"
        )
    # An arbitrary (e.g. strided) rank layout is accepted as-is: DeviceMesh keeps the flattened
    # tensor as its rank map and a row-major layout over it, so row i / column j of
    # ``mesh_layout()`` become exactly the "shard" / "replicate" sub-groups.
    mesh = DeviceMesh(device_type, dims.mesh_layout(), mesh_dim_names=MESH_DIM_NAMES)
    rank = dist.get_rank()
    coordinate = mesh.get_coordinate()
    if coordinate is None or tuple(coordinate) != dims.coords(rank):
        raise RuntimeError(f"DeviceMesh placed rank {rank} at {coordinate}, expected {dims.coords(rank)}")
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
        self.dims.check_rank(self.rank)

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
        """Groups of the calling rank, from the initialized default group via ``build_mesh``.

        With ``dims.world_size == 1`` and no initialized process group, returns groups that are
        all None (single process, no collectives). Otherwise this is a collective call (it
        creates the mesh's sub-groups on first use): every rank must call it.
        """
        if not has_process_group() and dims.world_size == 1:
            return cls(dims=dims, rank=0, world=None, shard=None, replica=None, mesh=None)
        mesh = build_mesh(dims, device_type)
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
