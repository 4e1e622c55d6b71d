"""This machine and its links, measured: inputs of the planner.

* ``probe``: the probe of the links and compute of every rank (``measure``, and ``measure_here``
  on local processes);
* ``resolve``: the strategy's ``links=``: a preset, a file, or measured at set-up by ``probe``;
* ``machine``: the memory a rank may count on (cgroup limits, the device).

Imports go to ``core``, ``distributed`` and ``planner``; ``resolve`` uses ``probe``.
"""
