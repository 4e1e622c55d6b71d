"""Distributed checkpoints of sharded models, read back on any mesh, and nothing run on load.

* ``format``: the tensor data's format and its safe reader (an exact allow-list, no foreign code),
  and the planners that write and read the tables as blocks;
* ``directory``: the directory's files and its protocol (write to a partial directory, mark
  complete, rename), checked before anything is read;
* ``tables``: the sharded tables and their row-wise states as blocks, and their accumulators' scales;
* ``optimizer``: the dense optimizers' states: their tensors in a distributed checkpoint, and a
  single file's state mapped onto the dense parameters;
* ``distributed``: ``save_distributed`` and ``load_distributed``, the strategies' entry points;
* ``export``: the full model on one process: ``consolidate`` (its state dict), ``lightning_checkpoint``
  (a single-file Lightning checkpoint of it) and ``load_from_checkpoint`` (a LightningModule from a
  checkpoint directory in one call).

Inside the package, imports go up this list (``export`` and ``distributed`` use the modules above
them); out of it, to the layers ``core``, ``lightning_twod.distributed``, ``sparse`` and ``replication``.
"""

from lightning_twod.checkpoint.directory import IncompleteCheckpointError, is_distributed_checkpoint, strategy_needed
from lightning_twod.checkpoint.export import consolidate, lightning_checkpoint, load_from_checkpoint

__all__ = ["IncompleteCheckpointError", "consolidate", "is_distributed_checkpoint", "lightning_checkpoint",
           "load_from_checkpoint", "strategy_needed"]
