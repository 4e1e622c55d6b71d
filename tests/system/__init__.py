"""The process tier: gloo worlds, ``torchrun`` and CLI subprocesses, notebooks and benchmarks."""
