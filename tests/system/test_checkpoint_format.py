"""Checkpoint blocks on 2 gloo processes: uneven 2-D blocks and a tensor held whole by one rank are
saved, read back into other blocks, and read into DTensors of any placement by DCP's own planner.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_twod.checkpoint.format import (
    BlockLoadPlanner,
    Blocks,
    BlockSavePlanner,
)
from tests.helpers import checkpoint_cases as K

# ----------------------------------------------------------------------------- blocks on 2 processes
FULL = torch.arange(7 * 8, dtype=torch.float32).reshape(7, 8)


OWNED = torch.arange(5, dtype=torch.float32) + 100  # held whole by rank 1, as a table-wise shard


# uneven 2-D blocks of FULL: rank 0 the top left and the bottom right, rank 1 the other two
SAVED_BLOCKS = {0: [(0, 0, 3, 5), (3, 5, 7, 8)], 1: [(0, 5, 3, 8), (3, 0, 7, 5)]}


LOADED_ROWS = {0: [(0, 2), (5, 7)], 1: [(2, 5)]}  # what each rank reads back: whole rows, uneven


def _blocks_worker(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, zeros

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = Blocks(FULL.shape, [((r0, c0), FULL[r0:r1, c0:c1].clone()) for r0, c0, r1, c1 in SAVED_BLOCKS[rank]])
        owned = Blocks(OWNED.shape, [((0,), OWNED.clone())] if rank == 1 else [])
        dcp.save({"dense": torch.ones(3)}, checkpoint_id=path,
                 planner=BlockSavePlanner({"full": saved, "owned": owned}))

        rows = Blocks(FULL.shape, [((r0, 0), torch.zeros(r1 - r0, 8)) for r0, r1 in LOADED_ROWS[rank]])
        whole = Blocks(OWNED.shape, [((0,), torch.zeros(5))])
        dense = {"dense": torch.zeros(3)}
        dcp.load(dense, storage_reader=FileSystemReader(path),
                 planner=BlockLoadPlanner({"full": rows, "owned": whole}, path))

        mesh = init_device_mesh("cpu", (world,))
        as_dtensors = {"full": zeros(FULL.shape, device_mesh=mesh, placements=[Shard(1)]),
                       "owned": zeros(OWNED.shape, device_mesh=mesh, placements=[Shard(0)])}
        dcp.load(as_dtensors, storage_reader=FileSystemReader(path))
    return {"rows": all(torch.equal(block, FULL[o[0]:o[0] + len(block)]) for o, block in rows.local),
            "owned": torch.equal(whole.local[0][1], OWNED), "dense": torch.equal(dense["dense"], torch.ones(3)),
            "dtensor full": torch.equal(as_dtensors["full"].full_tensor(), FULL),
            "dtensor owned": torch.equal(as_dtensors["owned"].full_tensor(), OWNED),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process read below
def test_uneven_blocks_load_into_other_blocks_and_into_dtensors(tmp_path):
    results = K.run_ranks(_blocks_worker, 2, str(tmp_path / "blocks"), timeout=120)
    for rank, result in enumerate(results):
        assert result == {"rows": True, "owned": True, "dense": True, "dtensor full": True, "dtensor owned": True,
                          "warnings": []}, f"rank {rank}"
    metadata = FileSystemReader(tmp_path / "blocks").read_metadata().state_dict_metadata
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in metadata["full"].chunks) == [
        ((0, 0), (3, 5)), ((0, 5), (3, 3)), ((3, 0), (4, 5)), ((3, 5), (4, 3))]
    assert [tuple(c.offsets) for c in metadata["owned"].chunks] == [(0,)]
    state = {"full": torch.zeros(7, 8), "owned": torch.zeros(5)}  # one process, plain tensors
    dcp.load(state, storage_reader=FileSystemReader(tmp_path / "blocks"), no_dist=True)
    assert torch.equal(state["full"], FULL) and torch.equal(state["owned"], OWNED)
