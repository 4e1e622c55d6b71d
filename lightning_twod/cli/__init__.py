"""Every command of ``lightning-twod`` (and ``python -m lightning_twod``).

* ``main``: the dispatcher; ``--version`` and ``--help`` import nothing heavy;
* ``fit``: LightningCLI (``fit``, ``validate``, ``test``, ``predict``) and ``plan``;
* ``planning``: the printouts of ``plan`` and the ``simulate`` command;
* ``demo``: a short 2x2 run on synthetic data.

The top layer: it may import any package.
"""
