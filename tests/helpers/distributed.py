"""Run a function on several CPU processes with a real gloo process group (spawn, not popen).

``run_distributed(worker, world_size, *args)`` starts ``world_size`` processes, each calling
``worker(rank, world_size, *args)`` after ``init_process_group("gloo")``, and returns the
list of their return values (rank order). A child's exception fails the caller with the child's
traceback; a child that does not finish within ``timeout`` seconds fails it too, and every child
is killed, so a hung collective cannot hang the test suite. A rank that fails or dies leaves its
peers gloo's "Connection reset by peer" (data sent to a process that has ended): the caller is
told the first rank to report an error, in full, the others' last lines after it, and any rank
that ended without a report (a crash, a signal) with its exit code.

The children come from a forkserver that imported torch, Lightning, FBGEMM and the tests' cases
once (``PRELOAD``): each starts in well under a second, where a spawned child would spend seconds
of CPU importing them again. A worker is pickled by name, so it lives at module level.

A child leaves only once every rank has its result (a final barrier): a rank that tore down its
process groups while a peer still worked with it would close the sockets under that peer.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _child(worker, rank, world_size, init_file, queue, args, final_barrier, init_group=True):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        if init_group:
            dist.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                timeout=timedelta(seconds=60),
            )
        # Pickled here: torch.multiprocessing would hand tensors over by file descriptor, which
        # fails in the parent (ConnectionResetError, FileNotFoundError) once this process has ended.
        result = pickle.dumps(worker(rank, world_size, *args))
        if final_barrier and dist.is_initialized():  # every rank is done with every collective
            dist.barrier()
        queue.put((rank, "ok", result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: Imported once by the forkserver, before any child: what every worker needs.
PRELOAD = ["tests.helpers.checkpoint_cases", "tests.helpers.sparse_cases",
           "fbgemm_gpu.split_table_batched_embeddings_ops_training"]


def preloaded_forkserver():
    """The forkserver context, its server started with ``PRELOAD`` imported (spawn where there is none)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    import multiprocessing.forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # effective when the forkserver starts (first use in the session)
    # The forkserver finds the preloaded modules on PYTHONPATH only (Python < 3.13 ignores the
    # parent's sys.path there): start it now with the repository on it.
    repository = Path(__file__).resolve().parents[2]
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(repository), *([before] if before else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def run_distributed(worker, world_size: int, *args, timeout: float = 180.0, context=None,
                    dead: int | None = None, init_group: bool = True):
    """``worker(rank, world_size, *args)`` on ``world_size`` gloo processes; their results.

    ``init_group=False``: the children start without a process group (the worker, or Lightning in
    it, makes one from the environment the worker sets, as under SLURM or torchrun).

    ``context``: the multiprocessing context (default: ``preloaded_forkserver()``). ``dead``: that rank is meant to end
    itself with ``os._exit(1)``; then the survivors' results come back as ``{rank: result}``, and
    the run fails when a survivor raised or hung, or when ``dead`` did not die with exit code 1.
    """
    ctx = context or preloaded_forkserver()
    results_queue = ctx.Queue()
    expected = world_size - (dead is not None)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(worker, rank, world_size, init_file, results_queue, args, dead is None,
                                             init_group), daemon=True)
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
                    rank, status, payload = results_queue.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - {dead} - set(results) - set(errors))
                    ended = {r: procs[r].exitcode for r in missing if procs[r].exitcode not in (None, 0)}
                    if ended:
                        raise AssertionError(f"rank(s) {sorted(ended)} ended without a report (exit codes {ended}; "
                                             "negative: the signal): the other ranks' connection errors follow "
                                             "from it") from None
                    if time.monotonic() < deadline:
                        continue
                    raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s (they hung)") from None
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
            if dead is not None and not errors:
                procs[dead].join(timeout=10)
                exitcode = procs[dead].exitcode
        finally:  # survivors may linger in the clean-up of a broken process group: not waited for long
            killed = set()
            for rank, proc in enumerate(procs):
                proc.join(timeout=2 if dead is not None or errors else 5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                    killed.add(rank)
        while errors:  # reports that came while the others were ended
            try:
                rank, status, payload = results_queue.get(timeout=0.5)
            except queue.Empty:
                break
            if status != "ok":
                errors.setdefault(rank, payload)
        if errors:
            rank = next(iter(errors))  # the first to report: the others' errors often follow from it
            silent = {r: p.exitcode for r, p in enumerate(procs)
                      if r not in results and r not in errors and r != dead and r not in killed and p.exitcode}
            first = (f"rank(s) {sorted(silent)} ended without a report (exit codes {silent}; negative: the signal), "
                     "and the errors below follow from it\n") if silent else ""
            others = "".join(f"\nrank {r} failed too: {e.strip().splitlines()[-1][:300]}"
                             for r, e in errors.items() if r != rank)
            raise AssertionError(f"{first}rank {rank} failed first:\n{errors[rank]}{others}")
    if dead is None:
        return [results[rank] for rank in range(world_size)]
    assert dead not in results, f"rank {dead} was meant to die but finished"
    assert exitcode == 1, f"rank {dead} ended with exit code {exitcode}, not by os._exit(1)"
    return results
