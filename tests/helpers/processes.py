"""The environment of a child process a system test starts (a CLI run, torchrun, a fresh interpreter)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What a launcher or an in-process run (Lightning sets MASTER_ADDR and MASTER_PORT where it makes a
#: process group) leaves in this process's environment: a child given them would join or bind that
#: group's address instead of making its own.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                    "NODE_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")


def child_env() -> dict[str, str]:
    """This environment, with the repository importable, one OpenMP thread per process, and none of the
    launch variables of a torchrun, SLURM or Lightning process group this process may carry."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCH_VARIABLES and not name.startswith(("TORCHELASTIC_", "SLURM_"))}
    return dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
