"""The unit tier's guard (``tests/unit/conftest.py``) refuses every way of starting a process."""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest


def test_a_subprocess_is_refused():
    with pytest.raises(RuntimeError, match="started a process"):
        subprocess.run(["true"], check=True)


@pytest.mark.parametrize("method", multiprocessing.get_all_start_methods())
def test_a_multiprocessing_child_is_refused(method):
    with pytest.raises(RuntimeError, match="started a process"):
        multiprocessing.get_context(method).Process(target=print).start()


def test_a_fork_is_refused():
    with pytest.raises(RuntimeError, match="started a process"):
        os.fork()
