"""Pickles that would run a command when loaded, and checkpoints with one planted in them.

``CALLS``: the global names a pickle calls (plain, and dotted ones pickle resolves at protocol >= 4);
``call_pickle`` builds one that would run ``TOUCH`` (create a marker file); ``plant_bytes_entry``
makes a checkpoint's ``.metadata`` declare ``DENSE`` as pickled bytes stored in ``EVIL_FILE``.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from lightning_twod.checkpoint.format import SafeFileSystemReader

TOUCH = "touch {marker}"
# (module, name) of a callable, and the argument that makes it create the marker file
CALLS = {
    ("os", "system"): TOUCH,
    ("posix", "system"): TOUCH,
    ("builtins", "eval"): "open({marker!r}, 'w').close()",
    # dotted: at protocol >= 4 pickle resolves "os.system" through the module's own `import os`
    ("torch.distributed.checkpoint.metadata", "os.system"): TOUCH,
    ("pathlib", "os.system"): TOUCH,
}
DENSE = "state_dict.net.bottom.weight"  # [8, 4]: a dense tensor every loader of the model requests
EVIL_FILE = "__9_0.distcp"


def pickled_text(value: str) -> bytes:
    data = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def pickled_global(module: str, name: str, protocol: int) -> bytes:
    """Pushes ``module.name``: GLOBAL at protocol 2, STACK_GLOBAL at 4 and 5 (as the pickler writes)."""
    if protocol < 4:
        return pickle.GLOBAL + f"{module}\n{name}\n".encode()
    return pickled_text(module) + pickled_text(name) + pickle.STACK_GLOBAL


def call_pickle(call: tuple[str, str], marker: Path, protocol: int) -> bytes:
    """A pickle whose loading calls ``call`` so that it creates ``marker``."""
    argument = CALLS[call].format(marker=str(marker))
    return (pickle.PROTO + bytes([protocol]) + pickled_global(*call, protocol) + pickled_text(argument) + pickle.TUPLE1
            + pickle.REDUCE + pickle.STOP)


def genuine_metadata(path: Path) -> Metadata:
    return SafeFileSystemReader(path).read_metadata()


def plant_bytes_entry(path: Path, call: tuple[str, str], protocol: int, marker: Path, with_size: bool = False) -> None:
    """``.metadata`` (allowed classes only) declares ``DENSE`` as pickled bytes held in a new data
    file whose pickle calls ``call``. ``with_size``: the bytes entry also carries the ``size`` and
    ``properties`` of the tensor it replaces, to pass for a tensor."""
    payload = call_pickle(call, marker, protocol)
    (path / EVIL_FILE).write_bytes(payload)
    metadata = genuine_metadata(path)
    entry = BytesStorageMetadata()
    if with_size:
        entry.size, entry.properties = metadata.state_dict_metadata[DENSE].size, metadata.state_dict_metadata[DENSE].properties
    metadata.state_dict_metadata[DENSE] = entry
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != DENSE}
    metadata.storage_data[MetadataIndex(DENSE)] = _StorageInfo(EVIL_FILE, 0, len(payload))
    (path / ".metadata").write_bytes(pickle.dumps(metadata, protocol=protocol))
