"""The test suite: ``unit/`` (starts no process; seconds), ``system/`` (process groups, subprocesses,
benchmarks; minutes), ``helpers/`` (shared cases and the process harness), ``data/``."""
