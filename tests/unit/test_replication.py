"""Row masks of the cross-group reduction on one process: bits packed and unpacked, and the rows a
lookup touches marked per slot in its shard (the rounds on 2 gloo processes:
``tests/system/test_replication.py``).
"""

from __future__ import annotations

import torch

from lightning_twod.core.reduction import GROWTH
from lightning_twod.replication.reducer import pack_bits, unpack_bits
from lightning_twod.replication.rounds import Workspace
from lightning_twod.replication.touched import TouchedRows
from tests.helpers.replication_cases import look_up, make_kernel


def test_bits_pack_and_unpack():
    for n in (1, 7, 8, 9, 100):
        mask = torch.rand(n) < 0.3
        packed = pack_bits(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
        assert torch.equal(unpack_bits(packed, n), mask)


def test_touched_rows_mark_each_slot_in_its_shard():
    kernel = make_kernel()
    touched = TouchedRows(kernel)
    look_up(kernel, [[1, 3], [7], [3, 39]])
    look_up(kernel, [[2], [], []])
    mask = touched.take()
    assert mask.numel() == 48, "one entry a row, however many lookups"
    assert mask.nonzero().squeeze(1).tolist() == [1, 2, 3, 39, 40 + 7]
    assert not touched.take().any(), "take() starts afresh"
    kernel.eval()
    kernel._observe(torch.tensor([5, 0, 0]), torch.tensor([1, 1, 1]))
    assert not touched.take().any(), "evaluation lookups update nothing, so they are not recorded"


def test_workspace_grows_with_headroom_and_reuses_its_buffers():
    space = Workspace(torch.device("cpu"))
    first = space.get("wire", 100)
    assert first.numel() == 100 and space.get("wire", 80).data_ptr() == first.data_ptr()
    grown = space.get("wire", 120)  # larger than before: room for the next slightly larger round
    assert grown.numel() == 120 and space.buffers["wire"].numel() == int(120 * GROWTH)
    assert space.get("wire", int(120 * GROWTH)).data_ptr() == grown.data_ptr()
    assert space.get("wire", 10, torch.bfloat16).dtype == torch.bfloat16  # another dtype: a new buffer
