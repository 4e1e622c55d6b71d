"""Decisions and errors that every rank shares, so that set-up never leaves ranks waiting.

A set-up step that fails on some ranks only (a node without FBGEMM, a user hook that raises on one
rank, a shard that only one rank holds) would let the other ranks walk into the next collective and
wait there until the process group's timeout. ``raise_on_every_rank`` closes such a step with one
small all-reduce of an error flag: if any rank failed, every rank raises the same exception, naming
the ranks and their messages. ``agree_min`` and ``check_same`` make per-rank readings and derived
decisions (memory, plans) one value for the whole world. ``own_error`` and ``lost_peer`` tell what a
rank itself raised from what it raised because a peer failed or left.

``group=None`` means no process group (one process): errors pass through unchanged.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_twod.distributed.groups import group_size


def reduce_device(group: ProcessGroup | None) -> torch.device:
    """A device the group's backend can reduce on (NCCL: this rank's CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def raise_on_every_rank(group: ProcessGroup | None) -> Iterator[None]:
    """Run the block; if it raised on any rank, raise on every rank (after one all-reduce).

    Every rank must enter and leave the block (the exit is a collective), so the block itself
    must not call collectives that a failed rank would skip. When all failing ranks raised the same
    message it is raised as it is; otherwise the message lists each failing rank's. The exception
    type is the first failing rank's (``RuntimeError`` if that type cannot be rebuilt from a message);
    it carries ``raised_on_every_rank = True``, so that one report of it is enough, and, where it
    joins several ranks' errors, this rank's own as ``rank_error`` (None where this rank raised
    nothing; ``own_error`` reads it).
    """
    error: Exception | None = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 (collected, then raised on every rank)
        error = err
    size = group_size(group)
    if size == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], device=reduce_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return
    reports: list[tuple[type, str] | None] = [None] * size
    dist.all_gather_object(reports, None if error is None else (type(error), str(error)), group=group)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    messages = {message for _, (_, message) in failed}
    if error is not None and len(messages) == 1 and len(failed) == size:
        error.raised_on_every_rank = True  # one report is enough (cli.errors)
        raise error  # the same failure everywhere: keep its own type, message and traceback
    ranks = [rank for rank, _ in failed]
    if len(messages) == 1:
        text = f"{failed[0][1][1]} (on rank(s) {ranks} of {size}; the others stopped with them)"
    else:
        text = "; ".join(f"rank {rank}: {message}" for rank, (_, message) in failed)
        text = f"set-up failed on rank(s) {ranks} of {size}: {text}"
    cls = failed[0][1][0]
    try:
        combined = cls(text)
    except Exception:  # noqa: BLE001 (an exception type with another signature)
        combined = RuntimeError(text)
    combined.raised_on_every_rank = True
    combined.rank_error = error  # None: this rank only stopped with the ranks that failed
    if error is not None:
        raise combined from error
    raise combined


def own_error(err: BaseException) -> BaseException | None:
    """What this rank itself raised, given what it caught: for an error ``raise_on_every_rank`` built
    from several ranks' errors, this rank's own (None if it had none); else ``err``."""
    return getattr(err, "rank_error", err)


#: What gloo and NCCL say when a peer crashed, ended or stopped answering (their exact texts: a
#: rank's own error, e.g. "DataLoader timed out after 30 seconds", is not one of them).
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"  # gloo's pair: the peer's socket closed
    r"Timed out waiting \d+ms for (?:send|recv) operation|Application timeout caused pair closure|"  # gloo's wait
    r"NCCL communicator was aborted|remote process exited or there was a network error|"  # NCCL's abort, ncclRemoteError
    r"Watchdog caught collective operation timeout"  # NCCL's watchdog
)


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is what a collective or the job's store raises on a rank whose peer failed or
    left (a ``DistNetworkError`` or ``DistStoreError``, or a runtime error with one of gloo's and
    NCCL's texts for a lost peer), not an error of the rank's own."""
    if isinstance(err, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(err, RuntimeError) and bool(_PEER_GONE.search(str(err)))


def agree_min(values: Sequence[float], group: ProcessGroup | None) -> list[float]:
    """The element-wise minimum of ``values`` over the group's ranks (float64, one all-reduce)."""
    if group_size(group) == 1:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=reduce_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return tensor.tolist()


def check_same(what: str, text: str, group: ProcessGroup | None) -> None:
    """Raise on every rank unless ``text`` (e.g. a plan's description) is the same on all ranks.

    The error names the ranks whose ``text`` differs from rank 0's.
    """
    size = group_size(group)
    if size == 1:
        return
    digest = hashlib.sha256(text.encode()).hexdigest()
    digests: list[str | None] = [None] * size
    dist.all_gather_object(digests, digest, group=group)
    differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise RuntimeError(
            f"the ranks disagree on the {what}: ranks {differing} computed another one than rank 0; "
            "every rank must see the same model, configuration and options"
        )
