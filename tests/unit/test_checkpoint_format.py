"""The tensor format of distributed checkpoints (``lightning_twod.checkpoint.format``).

* format versions: the committed format 1 checkpoint (``K.FORMAT1``, written through
  ``ShardedTensor``) consolidates without a warning; unknown or missing formats are refused;
* load plans (one process, no group): a rank reads just the saved chunks that overlap its blocks;
  wrong sizes and missing keys are refused with the checkpoint and the key named;
* blocks on 2 processes: uneven 2-D blocks and a tensor held whole by one rank are saved, read back
  into other blocks, and read into DTensors of any placement by DCP's own planner.
"""

from __future__ import annotations

import json
import shutil
import warnings

from tests.helpers import checkpoint_cases as K
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_twod.checkpoint import consolidate
from lightning_twod.checkpoint.format import (
    FORMAT,
    BlockLoadPlanner,
    Blocks,
    BlockSavePlanner,
    SafeFileSystemReader,
    check_format,
)

ROW_WISE = f"state_dict.{K.TABLE_KEYS[1]}"  # t_item [60, 8]: rows [0, 30) and [30, 60) on 2x2
COLUMN_WISE = f"state_dict.{K.COLUMN_WISE}"  # t_user [40, 8]: columns [0, 4) and [4, 8) on 2x2


# ----------------------------------------------------------------------------- format versions
def test_format1_consolidates_without_a_warning():
    assert check_format(K.FORMAT1) == "lightning-twod-checkpoint/1" != FORMAT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = consolidate(K.FORMAT1)
    module = K.make_lit(1)
    module.load_state_dict(state, strict=True)
    initial = K.make_lit(1).state_dict()
    assert all(not torch.equal(state[key], initial[key]) for key in K.TABLE_KEYS)  # the trained tables


def test_unknown_and_missing_formats_are_refused(tmp_path):
    copy = shutil.copytree(K.FORMAT1, tmp_path / "ckpt")
    layout = json.loads((copy / "layout.json").read_text())
    (copy / "layout.json").write_text(json.dumps({**layout, "format": "lightning-twod-checkpoint/9"}))
    with pytest.raises(ValueError, match=r"layout\.json: 'format' is 'lightning-twod-checkpoint/9'.*newer version"):
        consolidate(copy)
    (copy / "layout.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"layout\.json is not a JSON object with a 'format' key"):
        consolidate(copy)
    (copy / "layout.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt has no layout\.json, so its format is unknown"):
        consolidate(copy)


# ----------------------------------------------------------------------------- load plans
def _read_plan(blocks: dict[str, Blocks]) -> list:
    planner = BlockLoadPlanner(blocks, K.FORMAT1)
    planner.set_up_planner({}, SafeFileSystemReader(K.FORMAT1).read_metadata())
    return planner.create_local_plan().items


def _reads(items) -> list[tuple]:
    return sorted((tuple(i.storage_index.offset), tuple(i.storage_offsets), tuple(i.dest_offsets), tuple(i.lengths))
                  for i in items)


def test_a_rank_reads_only_the_saved_chunks_its_blocks_overlap():
    inside = Blocks(torch.Size([60, 8]), [((0, 0), torch.empty(15, 8))])  # rows [0, 15): the first chunk only
    assert _reads(_read_plan({ROW_WISE: inside})) == [((0, 0), (0, 0), (0, 0), (15, 8))]
    across = Blocks(torch.Size([60, 8]), [((20, 0), torch.empty(20, 8))])  # rows [20, 40): both chunks
    assert _reads(_read_plan({ROW_WISE: across})) == [((0, 0), (20, 0), (0, 0), (10, 8)),
                                                       ((30, 0), (0, 0), (10, 0), (10, 8))]
    columns = Blocks(torch.Size([40, 8]), [((10, 2), torch.empty(5, 4))])  # columns [2, 6) of rows [10, 15)
    assert _reads(_read_plan({COLUMN_WISE: columns})) == [((0, 0), (10, 2), (0, 0), (5, 2)),
                                                          ((0, 4), (10, 0), (0, 2), (5, 2))]
    assert _read_plan({ROW_WISE: Blocks(torch.Size([60, 8]), [])}) == []  # no block here, nothing read


def test_wrong_sizes_and_missing_keys_name_the_checkpoint_and_the_key():
    wrong = rf"checkpoint .*checkpoint_format1_2x2: {ROW_WISE} is \[60, 8\] there, \[61, 8\] here"
    with pytest.raises(ValueError, match=wrong):
        _read_plan({ROW_WISE: Blocks(torch.Size([61, 8]), [((0, 0), torch.empty(61, 8))])})
    with pytest.raises(KeyError, match=r"checkpoint .*checkpoint_format1_2x2 has no tensor state_dict.net.nothing"):
        _read_plan({"state_dict.net.nothing": Blocks(torch.Size([1]), [])})


def test_rows_that_no_saved_chunk_holds_are_refused():
    metadata = SafeFileSystemReader(K.FORMAT1).read_metadata()
    del metadata.state_dict_metadata[ROW_WISE].chunks[1]  # as if rows [30, 60) had not been written
    planner = BlockLoadPlanner({ROW_WISE: Blocks(torch.Size([60, 8]), [((20, 0), torch.empty(20, 8))])}, K.FORMAT1)
    planner.set_up_planner({}, metadata)
    with pytest.raises(ValueError, match=rf"the saved chunks of {ROW_WISE} leave parts of this rank's blocks "
                                         r"\[\[20, 0\]\] uncovered"):
        planner.create_local_plan()


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
