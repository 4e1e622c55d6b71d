"""A Trainer resume from a crafted checkpoint runs nothing: a format 2 checkpoint saved by a 2-process
fit, with a pickle planted in its ``.metadata`` or in a data file (``tests.helpers.crafted_checkpoints``),
fails to load on every rank, naming the refused entry, and no marker file appears (the other loaders:
``tests/unit/test_crafted_checkpoint.py``)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from tests.helpers import checkpoint_cases as K
from tests.helpers import strategy_cases as C
from tests.helpers.crafted_checkpoints import DENSE, call_pickle, plant_bytes_entry


# ----------------------------------------------------------------------------- a Trainer resume
def _resume_worker(rank: int, world: int, port: int, root: str) -> dict:
    C.as_external_rank(rank, world, port)
    saved = Path(root) / "saved"
    K.fit(1, 1, 1, callbacks=[K.SaveAtEpochEnd(saved)])  # a format 2 checkpoint of this version
    out = {}
    for route in ("metadata", "bytes"):
        crafted, marker = shutil.copytree(saved, Path(root) / route), Path(root) / f"marker_{route}"
        if route == "metadata":
            (crafted / ".metadata").write_bytes(
                call_pickle(("torch.distributed.checkpoint.metadata", "os.system"), marker, 4))
        else:
            plant_bytes_entry(crafted, ("os", "system"), 2, marker)
        try:
            K.fit(1, 1, 2, ckpt_path=crafted)
            out[route] = "loaded"
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - whatever it is, the parent checks it
            out[route] = str(err)
        out[f"{route} marker"] = marker.exists()
    return out


def test_a_trainer_resume_from_a_crafted_checkpoint_runs_nothing(tmp_path):
    (out,) = K.run_ranks(_resume_worker, 1, C.free_port(), str(tmp_path), timeout=240)
    assert out["metadata marker"] is out["bytes marker"] is False
    assert re.search(r"metadata: \.metadata refers to torch\.distributed\.checkpoint\.metadata\.os\.system", out["metadata"])
    assert re.search(rf"bytes: {DENSE} is saved as pickled bytes that torch\.load\(weights_only=True\) refuses "
                     r"\(.*os\.system", out["bytes"])
