"""What the tensor data of a distributed checkpoint holds, and how it is written and read.

The data is torch.distributed.checkpoint (DCP): ``.metadata`` lists every tensor under its key with
its full size and the **chunks** (offsets and sizes of the pieces) it was written in, and the
``.distcp`` files hold the pieces. A sharded table is one such tensor of its full ``[rows, dim]``
size; each shard is one chunk. The writers hand DCP their shards as :class:`Blocks` through the
planners below, which turn each block into one chunk; the readers ask for the blocks of their own
shards, and DCP reads from every saved chunk that overlaps one of them, whatever mesh wrote it.

Formats (``layout.json``'s ``format``):

* ``lightning-twod-checkpoint/2``: tables and their states written as blocks (this module);
* ``lightning-twod-checkpoint/1``: written through ``ShardedTensor`` (deprecated by torch). DCP
  recorded its shards as the same chunks, so the same reader loads it; nothing of
  ``ShardedTensor`` is needed for that.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

FORMAT = "lightning-twod-checkpoint/2"
READABLE_FORMATS = ("lightning-twod-checkpoint/1", FORMAT)
LAYOUT = "layout.json"


def check_format(path: Path) -> str:
    """The ``format`` of the checkpoint at ``path`` (from its ``layout.json``); raises unless readable."""
    file = path / LAYOUT
    if not file.exists():
        raise FileNotFoundError(f"checkpoint {path} has no {LAYOUT}, so its format is unknown")
    try:
        found = json.loads(file.read_text()).get("format")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{file} is not a JSON object with a 'format' key ({err})") from err
    if found not in READABLE_FORMATS:
        raise ValueError(f"{file}: 'format' is {found!r}; this version of lightning-twod reads "
                         f"{', '.join(READABLE_FORMATS)} (was it written by a newer version?)")
    return found


# --------------------------------------------------------------------------- safe reading
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: its own dataclasses, sizes, dtypes; nothing executable."""

    def find_class(self, module: str, name: str):
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` with a restricted unpickler."""

    def read_metadata(self):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(io.BytesIO(handle.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --------------------------------------------------------------------------- blocks
@dataclass
class Blocks:
    """This rank's blocks of one tensor of full ``size``: ``[(offsets, block)]``, possibly none.

    Saving: the blocks of all ranks tile the tensor exactly once (DCP checks it). Loading: each
    block is filled in place from the saved chunks it overlaps.
    """

    size: torch.Size
    local: list[tuple[tuple[int, ...], Tensor]]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=b.size()) for o, b in self.local]

    def find(self, index: MetadataIndex) -> Tensor:
        for offsets, block in self.local:
            if torch.Size(offsets) == index.offset:
                return block
        raise KeyError(f"{index.fqn} has no local block at offsets {list(index.offset or [])}")


def _write_item(fqn: str, size: torch.Size, offsets: tuple[int, ...], block: Tensor) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.size())
    return WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(block),
                                                 size=size))


class BlockSavePlanner(DefaultSavePlanner):
    """DCP's default save planner for the state dict, plus ``blocks`` (``{key: Blocks}``): one
    chunk per local block under its key."""

    def __init__(self, blocks: dict[str, Blocks]) -> None:
        super().__init__()
        self.blocks = blocks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [_write_item(fqn, b.size, offsets, block)
                 for fqn, b in self.blocks.items() for offsets, block in b.local]
        mappings = {**(plan.planner_data or {}), **{fqn: (fqn,) for fqn in self.blocks}}
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items], planner_data=mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.blocks:
            return self.blocks[index.fqn].find(index)
        return super().lookup_object(index)


class BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for the state dict, plus ``blocks`` (``{key: Blocks}``) read in
    place from the saved chunks they overlap; ``path`` names the checkpoint in errors."""

    def __init__(self, blocks: dict[str, Blocks], path: Path) -> None:
        super().__init__()
        self.blocks = blocks
        self.path = path

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for fqn, blocks in self.blocks.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            if saved is None or not hasattr(saved, "chunks"):
                raise KeyError(f"checkpoint {self.path} has no tensor {fqn}")
            if saved.size != blocks.size:
                raise ValueError(f"checkpoint {self.path}: {fqn} is {list(saved.size)} there, "
                                 f"{list(blocks.size)} here")
            reads = create_read_items_for_chunk_list(fqn, saved, blocks.chunks())
            covered = sum(math.prod(item.lengths) for item in reads)
            if covered != sum(block.numel() for _, block in blocks.local):
                raise ValueError(f"checkpoint {self.path}: the saved chunks of {fqn} leave parts of this "
                                 f"rank's blocks {[list(o) for o, _ in blocks.local]} uncovered")
            items += reads
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        if index.fqn in self.blocks:
            return self.blocks[index.fqn].find(index)
        return super().lookup_tensor(index)
