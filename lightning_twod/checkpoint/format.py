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

Reading runs no code from the checkpoint (:class:`SafeFileSystemReader`, used by every load of a
distributed checkpoint and by ``consolidate``): ``.metadata`` is a pickle, unpickled with an exact allow-list of (module, name)
pairs (DCP's metadata classes, ``torch.Size``, the dtypes, a layout by name, ``PosixPath``) that
sets state on instances of those classes only, then checked to be laid out as DCP writes it; any
other name, a dotted one included, is refused with the name and the checkpoint in the error. The
tensors are read with ``torch.load(weights_only=True)`` (DCP's own reader); a non-tensor entry
(pickled bytes) is read with ``torch.load(weights_only=True)`` too by :class:`BlockLoadPlanner`,
and refused under any other planner, whose ``load_bytes`` (DCP's) would unpickle anything.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pickle
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path, PosixPath

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.serialization import _get_layout

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
# Everything the .metadata of a DCP checkpoint refers to (torch 2.13; the same classes since 2.4),
# as exact (module, name) pairs: nothing else is looked up, and no dotted name.
_METADATA_CLASSES = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                     MetadataIndex, StorageMeta, _StorageInfo)
_ALLOWED = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.serialization", "_get_layout"): _get_layout,  # a layout from its name, e.g. "torch.strided"
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): PosixPath,  # StorageMeta.checkpoint_id
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata only: the pairs of ``_ALLOWED``, whose state (``BUILD``) may be set
    on instances of the metadata classes only, never on a class; the pure-Python unpickler, whose
    ``BUILD`` can be checked. Refusals name the pair and the checkpoint ``path``."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"checkpoint {self.path}: .metadata refers to {module}.{name} (module {module!r}, name "
                f"{name!r}), which DCP metadata never holds; refusing to load it")
        return _ALLOWED[module, name]

    def load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in _METADATA_CLASSES:
            raise pickle.UnpicklingError(f"checkpoint {self.path}: .metadata sets the state of {target!r}, "
                                         "which is not an instance of a DCP metadata class; refusing to load it")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


def _check_metadata(metadata, path: Path) -> None:
    """Raises unless ``metadata`` is laid out as DCP writes it: every entry a tensor's (dtype,
    ``size``, chunks) or a plain bytes marker, every storage location a file of ``path``."""

    def fail(what: str):
        raise ValueError(f"checkpoint {path}: .metadata {what}, which torch.distributed.checkpoint never writes")

    def exact(value, cls) -> bool:  # an instance of cls with no attribute beyond its fields
        return type(value) is cls and set(vars(value)) <= {f.name for f in dataclasses.fields(cls)}

    if not (exact(metadata, Metadata) and type(metadata.state_dict_metadata) is dict
            and type(metadata.storage_data) is dict and type(metadata.storage_meta) in (StorageMeta, type(None))):
        fail(f"holds a {type(metadata).__name__} that is not a Metadata of dicts")
    for key, entry in metadata.state_dict_metadata.items():
        bytes_marker = exact(entry, BytesStorageMetadata) and not vars(entry)
        if not (type(key) is str and (bytes_marker or (
                exact(entry, TensorStorageMetadata) and exact(entry.properties, TensorProperties)
                and type(entry.properties.dtype) is torch.dtype and type(entry.size) is torch.Size
                and type(entry.chunks) is list
                and all(exact(c, ChunkStorageMetadata) and type(c.offsets) is type(c.sizes) is torch.Size
                        and len(c.offsets) == len(c.sizes) == len(entry.size) for c in entry.chunks)))):
            fail(f"entry {key!r} is a malformed {type(entry).__name__}")
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not (exact(index, MetadataIndex) and exact(info, _StorageInfo) and type(name) is str
                and name == Path(name).name and name not in ("", ".", "..")
                and type(info.offset) is int and type(info.length) is int and min(info.offset, info.length) >= 0
                and (info.transform_descriptors is None or (type(info.transform_descriptors) in (list, tuple)
                                                             and all(type(d) is str for d in info.transform_descriptors)))):
            fail(f"locates {getattr(index, 'fqn', index)!r} at {info!r}, not in a file of the checkpoint")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` with :class:`_MetadataUnpickler` and checks its
    layout, and that hands pickled (non-tensor) entries only to a :class:`BlockLoadPlanner`, which
    loads them with ``torch.load(weights_only=True)`` (DCP's own planner would unpickle anything)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path)
        with open(path / ".metadata", "rb") as handle:
            metadata = _MetadataUnpickler(io.BytesIO(handle.read()), path).load()
        _check_metadata(metadata, path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        pickled = [item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if pickled and not isinstance(planner, BlockLoadPlanner):
            raise pickle.UnpicklingError(
                f"checkpoint {self.path}: {pickled[:5]} are saved as pickled bytes, which "
                f"{type(planner).__name__} would unpickle without restriction; load them with BlockLoadPlanner")
        return super().read_data(plan, planner)


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
    place from the saved chunks they overlap; non-tensor entries are read weights-only. ``path``
    names the checkpoint in errors."""

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

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """DCP's ``load_bytes`` (a non-tensor entry, e.g. a module's extra state), but read with
        ``torch.load(weights_only=True)``: DCP's own unpickles anything the data file holds."""
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            # torch's reason, e.g. "Trying to load unsupported GLOBAL os.system whose module os is blocked"
            reason = next((line.strip() for line in str(err).splitlines() if "nsupported" in line), str(err))
            reason = reason.split(". ")[0].removesuffix(".")
            raise pickle.UnpicklingError(f"checkpoint {self.path}: {fqn} is saved as pickled bytes that "
                                         f"torch.load(weights_only=True) refuses ({reason}); not loading it") from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
