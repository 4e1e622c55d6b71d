"""Helpers for tests and benchmarks.

* ``emulator``: the single-process emulator of a 2D run (every rank's copy in one process), the
  oracle that real multi-process runs are checked against.

Imports go to ``core``, ``sparse`` and ``replication``.
"""
