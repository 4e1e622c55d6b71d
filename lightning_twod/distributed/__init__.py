"""Distributed utilities: the mesh's process groups, collectives with byte accounting, agreement.

* ``groups``: ``has_process_group()`` (the one answer to "is torch.distributed initialized?"),
  ``group_size``, and ``MeshGroups`` (one rank's world, shard and replica groups, from the grid of
  ``core.mesh.SparseParallelDims``);
* ``exit_hook``: ``destroy_process_groups_at_exit``, which lets gloo's threads finish before the
  interpreter does;
* ``comm``: all-to-all and all-gather with explicit splits, differentiable, counted by ``ByteCounter``;
* ``consensus``: every rank raises the same error, or agrees on the minimum, or on one value.

Imports go to ``core`` only. The old module ``lightning_twod.topology`` is this package
(``lightning_twod._compat``): its names stay importable from here.
"""

from lightning_twod.core.mesh import MESH_DIM_NAMES, PLACEMENTS, Placement, SparseParallelDims
from lightning_twod.distributed.exit_hook import destroy_process_groups_at_exit
from lightning_twod.distributed.groups import MeshGroups, build_mesh, group_size, has_process_group

__all__ = ["MESH_DIM_NAMES", "PLACEMENTS", "MeshGroups", "Placement", "SparseParallelDims", "build_mesh",
           "destroy_process_groups_at_exit", "group_size", "has_process_group"]
