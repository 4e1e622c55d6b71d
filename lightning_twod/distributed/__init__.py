"""Distributed utilities: the mesh's process groups, collectives with byte accounting, agreement.

* ``topology``: ``SparseParallelDims`` (the grid's arithmetic), ``MeshGroups`` (one rank's process
  groups) and the exit hook that destroys them;
* ``comm``: all-to-all and all-gather with explicit splits, differentiable, counted by ``ByteCounter``;
* ``consensus``: every rank raises the same error, or agrees on the minimum, or on one value.

Imports go to ``core`` only.
"""
