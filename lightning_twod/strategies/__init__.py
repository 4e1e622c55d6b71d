"""Lightning and Fabric: the strategies users name, and what they share.

* ``registration``: ``strategy="twod_sparse"`` for the Trainer and Fabric (no Lightning import until needed);
* ``options``: ``TwoDOptions``, the 2D options both strategies take, checked once and frozen;
* ``engine``: ``TwoDSparseEngine``, the set-up, sparse step, reduction and checkpoint calls both strategies
  make (``EngineHost``: what it needs of the Lightning strategy it is mixed into);
* ``planning``: ``MeshPlanning``, the engine's planning half: the tables planned, the mesh built;
* ``strategy``: ``TwoDSparseStrategy`` (the Trainer's, a ``DDPStrategy``);
* ``fabric``: ``TwoDSparseFabricStrategy``;
* ``launcher``: spawn and fork launchers that shut process groups down cleanly;
* ``lookahead``: the Trainer glue of ``sparse.pipeline`` (ids sent one batch ahead);
* ``even_batches``: every rank runs the same number of batches;
* ``callbacks``: ``TrafficMonitor``, ``TwoDModelSummary``, ``PredictionWriter``;
* ``requeue``: SLURM's requeue signal, acted on at a batch end on every rank together.

Imports go to every layer below; nothing below imports this package.
"""
