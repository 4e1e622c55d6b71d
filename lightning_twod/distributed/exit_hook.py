"""An exit hook that lets gloo's threads finish before the interpreter does (a process-wide registration)."""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

from lightning_twod.distributed.groups import has_process_group

_EXIT_SETTLE_SECONDS = 0.1
_EXIT_HOOK_REGISTERED = False


def destroy_process_groups_at_exit() -> None:
    """Registers, once per process, an exit hook that lets gloo finish before the interpreter does.

    A gloo worker thread drops its reference to a finished collective just after the caller's
    ``wait()`` returns, and dropping the tensors of that work takes the GIL. A script that ends
    right after a collective can reach interpreter finalization first; the thread then aborts the
    process ("terminate called without an active exception") after training finished, its
    launcher reports a failed rank, and under torchrun the other nodes wait in their exit barrier.
    The hook destroys a gloo default group and its sub-groups (which joins gloo's threads when
    nothing else holds a group) and then releases the GIL briefly, so a thread still dropping
    its last work does so while the interpreter is whole.
    """
    global _EXIT_HOOK_REGISTERED
    if _EXIT_HOOK_REGISTERED:
        return

    def settle() -> None:  # NCCL groups are left to torch's own exit path
        if has_process_group() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        time.sleep(_EXIT_SETTLE_SECONDS)  # also after a script destroyed the groups itself

    atexit.register(settle)
    _EXIT_HOOK_REGISTERED = True
