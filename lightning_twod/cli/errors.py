"""An error the user can fix, reported as one message instead of a traceback per rank.

A user's error (``USER_ERRORS``: a configuration error, ``MisconfigurationException`` or a strategy
argument's ``OptionError``, also where the CLI's parser quotes it; a missing file; a bad Criteo
row) is printed as ``lightning-twod COMMAND: error: MESSAGE`` on stderr, without a traceback, and
the process exits with 1:

* raised on every rank (the consensus marks it ``raised_on_every_rank``; a configuration error
  raised before there is a process group is the same in every process): rank 0 prints it;
* raised on some ranks: each prints it with its rank.

Any other error keeps its traceback, printed by rank 0 alone where every rank raised it. Every
rank prints what it raised itself, also where the consensus joined it with other ranks' errors
(a user's error on one rank never hides a bug on another); a rank that only stopped with the
failing ones prints nothing, and a rank that printed marks it in the job's store, so that the ranks
that then fail in a collective whose peer is gone end without a traceback.
``LIGHTNING_TWOD_TRACEBACK=1`` keeps every traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod.datasets.criteo import BadRow
from lightning_twod.distributed.consensus import lost_peer, own_error
from lightning_twod.strategies.options import OptionError

#: Errors of the configuration alone: every process that reads it raises the same one.
CONFIG_ERRORS = (MisconfigurationException, OptionError)
#: What a user fixes in the config, the command line or the data, whatever rank it happened on.
USER_ERRORS = (*CONFIG_ERRORS, FileNotFoundError, BadRow)
#: Seconds a store call may wait while a rank reports and ends.
STORE_TIMEOUT_S = 5
#: How the CLI's parser (jsonargparse) quotes the error of a strategy it could not make.
_QUOTED = re.compile(r"^\s*- (TwoDSparse(?:Fabric)?Strategy: .+)$", re.MULTILINE)
#: The store key of a rank that printed why it stopped.
REPORTED = "lightning_twod/cli/reported"


def _rank() -> int | None:
    """This process's global rank in a job of several (process group, torchrun or SLURM), else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    for rank, world in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if os.environ.get(rank) is not None and os.environ.get(world) not in (None, "1"):
            return int(os.environ[rank])
    return None


def _store() -> Any:
    """The job's key-value store (the default process group's), waiting at most 5 s; None without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))  # a host already gone must not hold this rank
    return store


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


def _users(err: BaseException | None) -> BaseException | None:
    """The user's error that ``err`` is, was raised from, or quotes (the CLI's parser turns a strategy
    argument's ``OptionError`` into a line of a ``ValueError`` of its own), else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, USER_ERRORS):
            return err
        quoted = _QUOTED.search(str(err)) if isinstance(err, ValueError) else None
        if quoted:
            return OptionError(quoted.group(1))
        seen.add(id(err))
        err = err.__cause__
    return None


def run_reporting_errors(command: str, run: Callable[[], Any]) -> Any:
    """``run()``; an error ends the process with one message or its traceback (see the module docstring)."""
    try:
        return run()
    except Exception as raised:
        if os.environ.get("LIGHTNING_TWOD_TRACEBACK") == "1":
            raise
        own = own_error(raised)  # what this rank raised itself, where the consensus joined several ranks' errors
        if own is None:
            sys.exit(1)  # this rank only stopped with the ranks that failed: they print why
        rank, err = _rank(), _users(own)
        if err is None:  # not the user's: its traceback stays, once
            if getattr(own, "raised_on_every_rank", False) and rank not in (None, 0):
                sys.exit(1)  # every rank raised it: rank 0 shows the traceback
            if lost_peer(own) and _reported_elsewhere():
                sys.exit(1)  # another rank printed why the job stopped; this one only lost its peer
            _mark_reported()
            if own is not raised:
                raise own from own.__cause__  # its own traceback, not the consensus's
            raise
        _mark_reported()
        # the same on every rank: what the consensus raised, and the configuration's own errors raised
        # before there is a process group (every process checks the same config)
        everywhere = getattr(err, "raised_on_every_rank", False) or (isinstance(err, CONFIG_ERRORS)
                                                                     and _store() is None)
        if everywhere and rank not in (None, 0):
            sys.exit(1)  # rank 0 prints it
        where = "" if rank is None or everywhere else f"rank {rank}: "
        print(f"lightning-twod {command}: error: {where}{err}\n(LIGHTNING_TWOD_TRACEBACK=1 shows where it was "
              "raised)", file=sys.stderr, flush=True)
        sys.exit(1)
