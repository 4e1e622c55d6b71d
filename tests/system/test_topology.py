"""The mesh's real process groups: one 4-process gloo run checks the DeviceMesh groups for both
placements, and processes leave cleanly right after a collective."""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_twod.distributed import MESH_DIM_NAMES, MeshGroups, SparseParallelDims, build_mesh

WORLD = 4


EXPECTED = {
    # placement: (shard groups, replica groups) of the 2 x 2 grid
    "contiguous": ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "strided": ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
}


def _group_containing(groups, rank):
    (group,) = [g for g in groups if rank in g]
    return group


def _mesh_worker(rank: int, init_file: str) -> None:
    """Child process: check the groups of both placements on a 2 x 2 grid."""
    import warnings

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    try:
        # a wrong world size is refused, naming both numbers
        try:
            build_mesh(SparseParallelDims(8, 4))
        except RuntimeError as err:
            assert "4" in str(err) and "world_size=8" in str(err), err
        else:
            raise AssertionError("build_mesh accepted a world size mismatch")

        for placement, (shard_groups, replica_groups) in EXPECTED.items():
            dims = SparseParallelDims(WORLD, 2, placement=placement)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # DeviceMesh must take the layout silently
                groups = MeshGroups.create(dims)
            want_shard = _group_containing(shard_groups, rank)
            want_replica = _group_containing(replica_groups, rank)

            assert groups.rank == rank
            assert groups.shard_ranks == want_shard, (placement, groups.shard_ranks)
            assert groups.replica_ranks == want_replica, (placement, groups.replica_ranks)
            assert dist.get_process_group_ranks(groups.shard) == want_shard, placement
            assert dist.get_process_group_ranks(groups.replica) == want_replica, placement
            assert dist.get_process_group_ranks(groups.world) == list(range(WORLD))
            assert dist.get_rank(groups.shard) == groups.shard_rank == want_shard.index(rank)
            assert dist.get_rank(groups.replica) == groups.replica_rank == want_replica.index(rank)

            mesh = groups.mesh
            assert mesh.mesh_dim_names == MESH_DIM_NAMES
            assert mesh.mesh.tolist() == dims.mesh_layout().tolist()
            assert tuple(mesh.get_coordinate()) == dims.coords(rank)

            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=groups.shard)
            assert t.item() == sum(want_shard), (placement, t.item(), want_shard)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=groups.replica)
            assert t.item() == sum(want_replica), (placement, t.item(), want_replica)

            # the dims stay a plain value after a mesh was built from them (nothing is attached to them)
            assert dataclasses.asdict(dims) == {"world_size": WORLD, "shard_group_size": 2,
                                                "placement": placement, "ranks_per_node": None}
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_mesh_groups_four_processes(tmp_path):
    import torch.multiprocessing as mp

    init_file = str(tmp_path / "init")
    ctx = mp.start_processes(
        _mesh_worker, args=(init_file,), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 60
    try:
        # join() re-raises a child's exception (and terminates the others)
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{WORLD}-process mesh test timed out")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def test_processes_exit_cleanly_right_after_a_collective(tmp_path):
    """Two processes that end right after gloo collectives exit with 0 every time, and the process
    groups are gone when the interpreter finalizes. Without the exit hook, about a third of such
    processes abort ("terminate called without an active exception")."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    script = root / "tests" / "helpers" / "scripts" / "exit_after_collective.py"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for attempt in range(6):
        store = tmp_path / f"store{attempt}"
        procs = [
            subprocess.Popen([sys.executable, str(script), str(rank), str(store)], cwd=root, env=env,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for rank in (0, 1)
        ]
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"attempt {attempt}, rank {rank}: exit code {proc.returncode}\n{err}"
            assert "initialized after the hook: False" in out, out
