"""The tensor format of distributed checkpoints (``lightning_twod.checkpoint.format``), on one process.

* format versions: the committed format 1 checkpoint (``K.FORMAT1``, written through
  ``ShardedTensor``) consolidates without a warning; unknown or missing formats are refused;
* load plans (one process, no group): a rank reads just the saved chunks that overlap its blocks;
  wrong sizes and missing keys are refused with the checkpoint and the key named.

The blocks saved and loaded on 2 processes: ``tests/system/test_checkpoint_format.py``.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from lightning_twod.checkpoint import consolidate
from lightning_twod.checkpoint.format import (
    FORMAT,
    BlockLoadPlanner,
    Blocks,
    SafeFileSystemReader,
    check_format,
)
from tests.helpers import checkpoint_cases as K

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


