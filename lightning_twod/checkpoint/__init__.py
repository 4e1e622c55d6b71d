"""Distributed checkpoints of sharded models, read back on any mesh, and nothing run on load.

* ``format``: the safe reader of a checkpoint directory (an exact allow-list, no foreign code);
* ``store``: the directory protocol (write to a partial directory, mark complete, rename), the
  tables' blocks, the dense optimizer's mapping and ``consolidate``.

Imports go to ``core``, ``distributed``, ``sparse`` and ``replication``.
"""

from lightning_twod.checkpoint.store import consolidate

__all__ = ["consolidate"]
