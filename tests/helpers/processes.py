"""The environment of a child process a system test starts (a CLI run, torchrun, a fresh interpreter)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """This environment, with the repository importable and one OpenMP thread per process."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")
