"""Run a function on several CPU processes with a real gloo process group (spawn, not popen).

``run_distributed(worker, world_size, *args)`` starts ``world_size`` spawned processes, each
calling ``worker(rank, world_size, *args)`` after ``init_process_group("gloo")``, and returns the
list of their return values (rank order). A child's exception fails the caller with the child's
traceback; a child that does not finish within ``timeout`` seconds fails it too, and every child
is killed, so a hung collective cannot hang the test suite.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _child(worker, rank, world_size, init_file, queue, args):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        # Pickled here: torch.multiprocessing would hand tensors over by file descriptor, which
        # fails in the parent (ConnectionResetError, FileNotFoundError) once this process has ended.
        queue.put((rank, "ok", pickle.dumps(worker(rank, world_size, *args))))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(worker, world_size: int, *args, timeout: float = 180.0, context=None,
                    dead: int | None = None):
    """``worker(rank, world_size, *args)`` on ``world_size`` gloo processes; their results.

    ``context``: the multiprocessing context (default: spawn). ``dead``: that rank is meant to end
    itself with ``os._exit(1)``; then the survivors' results come back as ``{rank: result}``, and
    the run fails when a survivor raised or hung, or when ``dead`` did not die with exit code 1.
    """
    ctx = context or mp.get_context("spawn")
    results_queue = ctx.Queue()
    expected = world_size - (dead is not None)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(worker, rank, world_size, init_file, results_queue, args), daemon=True)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        exitcode = None
        try:
            while len(results) + len(errors) < expected and not errors:
                try:
                    rank, status, payload = results_queue.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - {dead} - set(results) - set(errors))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s (they hung)") from None
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
            if dead is not None and not errors:
                procs[dead].join(timeout=10)
                exitcode = procs[dead].exitcode
        finally:  # survivors may linger in the clean-up of a broken process group: not waited for long
            for proc in procs:
                proc.join(timeout=2 if dead is not None or errors else 5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    if dead is None:
        return [results[rank] for rank in range(world_size)]
    assert dead not in results, f"rank {dead} was meant to die but finished"
    assert exitcode == 1, f"rank {dead} ended with exit code {exitcode}, not by os._exit(1)"
    return results
