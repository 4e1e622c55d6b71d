"""What the cluster offers, measured: inputs of the planner.

* ``links``: the probe of the links and compute of every rank, and the resolution of ``links=``;
* ``machine``: the memory a rank may count on (cgroup limits, the device).

Imports go to ``core``, ``distributed`` and ``planner``.
"""
