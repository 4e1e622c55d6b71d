"""Every command of ``lightning-twod`` (and ``python -m lightning_twod``), one module each.

* ``main``: the dispatcher; ``--version`` and ``--help`` import nothing heavy, and each command's
  module is imported only once it is chosen;
* ``fit``: LightningCLI (``fit``, ``validate``, ``test``, ``predict``), the parser ``plan`` shares;
* ``plan``: the plan ``fit`` will log, on the links ``fit`` uses, and 1D beside it;
* ``simulate``: the at-scale prediction of 1D and 2D (the planner only: no torch);
* ``calibrate``: measure this cluster's links and compute, written as YAML for ``links=``;
* ``consolidate``: a checkpoint's full state dict as one file;
* ``prepare_criteo``: Criteo TSV files converted once into Parquet row groups that ranks split;
* ``demo``: a short 2x2 run on synthetic data.

The top layer: it may import any package.
"""
