"""A crafted checkpoint must not run code when it is loaded.

Each case takes a real checkpoint (the committed format 1 one, or a fresh format 2 one saved by a
Trainer) and plants a pickle that would create a marker file, at pickle protocols 2, 4 and 5, with
plain global names (``os.system``, ``posix.system``, ``builtins.eval``) and dotted ones that
pickle resolves through an allowed module's own imports at protocol >= 4
(``torch.distributed.checkpoint.metadata`` + ``os.system``). Two routes:

* ``.metadata`` itself: the restricted unpickler refuses the name, and refuses to set attributes
  on a class; a ``.metadata`` of allowed classes in the wrong places is refused too;
* a data file: a ``.metadata`` of allowed classes declares a requested key as pickled bytes
  (``BytesStorageMetadata``), which DCP's own planner would ``torch.load(weights_only=False)``.

Every load raises an error naming the refused name (or the refused entry) and the checkpoint, and
no marker file appears: through ``consolidate``, the strategy's reader and planner in this process,
DCP's own planner under the safe reader, and a Trainer resume. Genuine pickled entries still load.
"""

from __future__ import annotations

import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from lightning_twod.checkpoint import consolidate
from lightning_twod.checkpoint.format import BlockLoadPlanner, SafeFileSystemReader
from tests.helpers import checkpoint_cases as K
from tests.helpers.crafted_checkpoints import (
    CALLS,
    DENSE,
    call_pickle,
    genuine_metadata,
    pickled_global,
    pickled_text,
    plant_bytes_entry,
)

PROTOCOLS = (2, 4, 5)
PLAIN = [call for call in CALLS if "." not in call[1]]
ERRORS = (pickle.UnpicklingError, ValueError, CheckpointException)  # DCP wraps what fails inside it


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A copy of a real checkpoint (format 1, saved on 2x2 by the strategy)."""
    return shutil.copytree(K.FORMAT1, tmp_path / "ckpt")


def _quiet_load(state: dict, reader, **kwargs) -> None:
    with warnings.catch_warnings():  # that no process group exists: none is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True, **kwargs)


def load_as_the_strategy_does(path: Path) -> None:
    """What ``load_distributed`` runs for a dense weight: the safe reader, then the block planner."""
    reader = SafeFileSystemReader(path)
    reader.read_metadata()
    _quiet_load({DENSE: torch.empty(8, 4)}, reader, planner=BlockLoadPlanner({}, path))


def load_with_dcps_planner(path: Path) -> None:
    """The safe reader under DCP's own load planner."""
    _quiet_load({DENSE: torch.empty(8, 4)}, SafeFileSystemReader(path))


def error_of(load, path: Path) -> str:
    with pytest.raises(ERRORS) as info:
        load(path)
    return str(info.value)


# ----------------------------------------------------------------------------- route 1: .metadata
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("call", list(CALLS), ids=".".join)
@pytest.mark.parametrize("load", [consolidate, load_as_the_strategy_does, load_with_dcps_planner],
                         ids=lambda f: f.__name__)
def test_metadata_that_calls_a_global_is_refused(checkpoint, tmp_path, call, protocol, load):
    marker = tmp_path / "marker"
    (checkpoint / ".metadata").write_bytes(call_pickle(call, marker, protocol))
    module, name = call
    assert re.search(rf"checkpoint \S*ckpt: \.metadata refers to {re.escape(module)}\.{re.escape(name)} "
                     rf"\(module {re.escape(repr(module))}, name {re.escape(repr(name))}\)", error_of(load, checkpoint))
    assert not marker.exists()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_metadata_that_sets_attributes_of_a_class_is_refused(checkpoint, protocol):
    """BUILD with a slot state on an allowed class (not an instance) would set class attributes."""
    poison = (pickle.PROTO + bytes([protocol]) + pickled_global("torch.distributed.checkpoint.metadata", "Metadata", protocol)
              + pickle.NONE + pickle.EMPTY_DICT + pickled_text("poisoned") + pickle.NEWTRUE + pickle.SETITEM
              + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    (checkpoint / ".metadata").write_bytes(poison)
    message = error_of(consolidate, checkpoint)
    assert not hasattr(Metadata, "poisoned")
    assert re.search(r"checkpoint \S*ckpt: \.metadata sets the state of <class '\S+\.Metadata'>, which is not an "
                     r"instance of a DCP metadata class", message)


def test_metadata_of_allowed_classes_in_wrong_places_is_refused(checkpoint):
    metadata = genuine_metadata(checkpoint)
    outside = _StorageInfo("../elsewhere/__0_0.distcp", 0, 10)
    metadata.storage_data[MetadataIndex(DENSE, torch.Size([0, 0]))] = outside
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    assert re.search(rf"checkpoint \S*ckpt: \.metadata locates '{DENSE}' at .*elsewhere.*, not in a file of the "
                     "checkpoint", error_of(consolidate, checkpoint))
    metadata.state_dict_metadata[DENSE] = torch.Size([8, 4])
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    assert re.search(rf"\.metadata entry '{DENSE}' is a malformed Size", error_of(consolidate, checkpoint))


# ----------------------------------------------------------------------------- route 2: a data file
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("call", PLAIN, ids=".".join)
def test_a_pickled_entry_is_read_weights_only(checkpoint, tmp_path, call, protocol):
    marker = tmp_path / "marker"
    plant_bytes_entry(checkpoint, call, protocol, marker)
    message = error_of(load_as_the_strategy_does, checkpoint)
    assert not marker.exists()
    # torch's weights-only unpickler names a GLOBAL (protocol 2, what torch.save writes); at 4 and 5
    # it already refuses the STACK_GLOBAL opcode that would look the name up
    module, name = call
    refused = rf"GLOBAL ({re.escape(module)}\.)?{name} " if protocol == 2 else "Unsupported operand 147"
    assert re.search(rf"checkpoint \S*ckpt: {DENSE} is saved as pickled bytes that "
                     rf"torch\.load\(weights_only=True\) refuses \([^)]*{refused}[^)]*\); not loading it", message), message


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("call", PLAIN, ids=".".join)
def test_dcps_planner_gets_no_pickled_entry_from_the_safe_reader(checkpoint, tmp_path, call, protocol):
    marker = tmp_path / "marker"
    plant_bytes_entry(checkpoint, call, protocol, marker)
    message = error_of(load_with_dcps_planner, checkpoint)
    assert not marker.exists()
    assert re.search(rf"checkpoint \S*ckpt: \['{DENSE}'\] are saved as pickled bytes, which DefaultLoadPlanner "
                     "would unpickle without restriction", message), message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_pickled_entry_dressed_as_a_tensor_is_refused(checkpoint, tmp_path, protocol):
    """``consolidate`` reads every entry that has a ``size``: a bytes entry with one is refused."""
    marker = tmp_path / "marker"
    plant_bytes_entry(checkpoint, ("os", "system"), protocol, marker, with_size=True)
    message = error_of(consolidate, checkpoint)
    assert not marker.exists()
    assert re.search(rf"checkpoint \S*ckpt: \.metadata entry '{DENSE}' is a malformed BytesStorageMetadata", message)


def test_genuine_pickled_entries_still_load(tmp_path):
    """A non-tensor entry (e.g. a module's extra state) is written by DCP with torch.save, and loads."""
    path = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save({"weight": torch.ones(3), "extra": {"step": 7, "name": "a"}}, checkpoint_id=path, no_dist=True)
    state = {"weight": torch.zeros(3), "extra": {"step": 0, "name": ""}}
    _quiet_load(state, SafeFileSystemReader(path), planner=BlockLoadPlanner({}, path))
    assert torch.equal(state["weight"], torch.ones(3)) and state["extra"] == {"step": 7, "name": "a"}
