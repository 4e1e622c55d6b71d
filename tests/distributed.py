"""Run a function on several CPU processes with a real gloo process group (spawn, not popen).

``run_distributed(worker, world_size, *args)`` starts ``world_size`` spawned processes, each
calling ``worker(rank, world_size, *args)`` after ``init_process_group("gloo")``, and returns the
list of their return values (rank order). A child's exception fails the caller with the child's
traceback; a child that does not finish within ``timeout`` seconds fails it too, and every child
is killed, so a hung collective cannot hang the test suite.
"""

from __future__ import annotations

import os
import tempfile
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
        result = worker(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(worker, world_size: int, *args, timeout: float = 180.0) -> list:
    """``worker(rank, world_size, *args)`` on ``world_size`` gloo processes; their results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(worker, rank, world_size, init_file, queue, args), daemon=True)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout)
                (results if status == "ok" else errors)[rank] = payload
                if errors:
                    break
        except Exception as exc:  # queue.Empty: some rank hung
            missing = sorted(set(range(world_size)) - set(results) - set(errors))
            raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s") from exc
        finally:
            for proc in procs:
                proc.join(timeout=5 if not errors else 0.5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[rank] for rank in range(world_size)]
