"""The unit tier starts no process: in ``tests/unit`` (fixtures included) starting one fails the test.

Patched while each test's setup, call and teardown run: ``subprocess.Popen`` (``run``,
``check_output``), ``multiprocessing``'s ``Process.start`` (``spawn``, forkserver, pools and
``torch.multiprocessing.spawn``), and ``os.fork`` / ``posix_spawn`` / ``system``. A test that needs a
process belongs in ``tests/system``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

STARTERS = [(subprocess.Popen, "__init__"), (multiprocessing.process.BaseProcess, "start")]
STARTERS += [(os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system") if hasattr(os, name)]


def _refuse(*args, **kwargs):
    raise RuntimeError("a unit test started a process: tests that start processes belong in tests/system")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in STARTERS:
            patch.setattr(owner, name, _refuse)
        yield


# the same guard around the test itself and its teardown (module fixtures end there)
pytest_runtest_call = pytest_runtest_setup
pytest_runtest_teardown = pytest_runtest_setup
