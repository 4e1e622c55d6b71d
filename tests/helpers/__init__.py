"""Shared by the tests of both tiers, imported as ``tests.helpers.<module>`` (spawned children too).

* ``distributed``: ``run_distributed``, a function on several gloo processes (children of a
  forkserver that imported the heavy modules once);
* ``strategy_cases``: the small click model, data and fits of the strategy tests;
* ``sparse_cases``: tables, constraints and batches of the sharded-module tests;
* ``bad_batches``: corrupted copies of those batches and what their errors must say;
* ``checkpoint_cases``: fits that save and the readers of the checkpoint tests;
* ``crafted_checkpoints``: pickles that would run code, planted in checkpoints;
* ``replication_cases``: a small replicated kernel and the lookups it records;
* ``scripts/``: programs the tests start with ``torchrun`` or ``python``.
"""
