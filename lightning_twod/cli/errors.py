"""An error the user can fix, reported as one message instead of a traceback per rank.

A configuration error (``MisconfigurationException``, a strategy argument's ``OptionError``, also
where the CLI's parser quotes it), a missing file, a bad Criteo row, or any
error the strategy raised on every rank at once (``consensus.raise_on_every_rank`` marks it) is
printed as ``lightning-twod COMMAND: error: MESSAGE`` on stderr and the process exits with 1. An
error raised on every rank is printed by rank 0 only (its message names the ranks where they
differ); one raised on some ranks is printed by each of them, prefixed with its rank, and marked
in the job's store, so that the other ranks, which then fail in a collective whose peer is gone,
end without a traceback of their own. Any other exception keeps its traceback, and
``LIGHTNING_TWOD_TRACEBACK=1`` keeps it for these too.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod.datasets.criteo import BadRow
from lightning_twod.integration.options import OptionError

#: What a user fixes in the config, the command line or the data, whatever rank it happened on.
USER_ERRORS = (MisconfigurationException, OptionError, FileNotFoundError, BadRow)
#: How the CLI's parser (jsonargparse) quotes the error of a strategy it could not make.
_QUOTED = re.compile(r"^\s*- (TwoDSparse(?:Fabric)?Strategy: .+)$", re.MULTILINE)
#: The store key of a rank that reported a user's error.
REPORTED = "lightning_twod/cli/reported"


def _rank() -> int | None:
    """This process's global rank in a job of several, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return int(rank) if rank is not None and world not in (None, "1") else None


def _store() -> Any:
    """The job's key-value store (the default process group's), or None without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _mark_reported() -> None:
    try:
        store = _store()
        if store is not None:
            store.set(REPORTED, "1")
    except Exception:  # noqa: BLE001 (a store already gone: the peers then print their own tracebacks)
        pass


def _reported_elsewhere() -> bool:
    try:
        store = _store()
        return store is not None and store.check([REPORTED])
    except Exception:  # noqa: BLE001 (no store to ask: keep the traceback)
        return False


def _users(err: BaseException) -> BaseException | None:
    """The user's error that ``err`` is, was raised while handling, or quotes (the CLI's parser
    turns a strategy argument's ``OptionError`` into a line of a ``ValueError`` of its own), else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, USER_ERRORS):
            return err
        quoted = _QUOTED.search(str(err)) if isinstance(err, ValueError) else None
        if quoted:
            return OptionError(quoted.group(1))
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def run_reporting_errors(command: str, run: Callable[[], Any]) -> Any:
    """``run()``; a user's error ends the process with one message (see the module docstring)."""
    try:
        return run()
    except Exception as raised:
        err = _users(raised) or raised
        on_every_rank = getattr(err, "raised_on_every_rank", False)
        if os.environ.get("LIGHTNING_TWOD_TRACEBACK") == "1":
            raise
        if not (on_every_rank or isinstance(err, USER_ERRORS)):
            if _reported_elsewhere():
                sys.exit(1)  # another rank printed why the job stopped; this one only lost its peer
            raise
        _mark_reported()
        rank = _rank()
        if on_every_rank and rank not in (None, 0):
            sys.exit(1)  # rank 0 prints it
        where = "" if rank is None or on_every_rank else f"rank {rank}: "
        print(f"lightning-twod {command}: error: {where}{err}\n(LIGHTNING_TWOD_TRACEBACK=1 shows where it was "
              "raised)", file=sys.stderr, flush=True)
        sys.exit(1)
