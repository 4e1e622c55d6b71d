"""Old module paths of the public names, kept importable after the modules moved into their layers.

``import lightning_twod.callbacks`` (or ``class_path: lightning_twod.callbacks.TrafficMonitor`` in a
config) still works: a finder answers each old path with the module that lives at the new one (the
same module object, so ``isinstance`` and monkeypatching see one module). A module that was split
is answered by the part that holds its documented names: ``lightning_twod.links`` by ``hardware.probe``
(``measure``), ``lightning_twod.topology`` by the ``distributed`` package. The packages renamed whole
(``integration`` is ``strategies``, ``cluster`` is ``hardware``) answer every module below them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

#: Old module path -> where the module lives now.
MOVED = {
    "lightning_twod.callbacks": "lightning_twod.strategies.callbacks",
    "lightning_twod.checkpoint_format": "lightning_twod.checkpoint.format",
    "lightning_twod.consensus": "lightning_twod.distributed.consensus",
    "lightning_twod.demo": "lightning_twod.cli.demo",
    "lightning_twod.emulation": "lightning_twod.testing.emulator",
    "lightning_twod.engine": "lightning_twod.strategies.engine",
    "lightning_twod.even_batches": "lightning_twod.strategies.even_batches",
    "lightning_twod.fabric": "lightning_twod.strategies.fabric",
    "lightning_twod.launcher": "lightning_twod.strategies.launcher",
    "lightning_twod.links": "lightning_twod.hardware.probe",
    "lightning_twod.lookahead": "lightning_twod.strategies.lookahead",
    "lightning_twod.machine": "lightning_twod.hardware.machine",
    "lightning_twod.shards": "lightning_twod.core.shards",
    "lightning_twod.sparse.comm": "lightning_twod.distributed.comm",
    "lightning_twod.sparse.features": "lightning_twod.core.features",
    "lightning_twod.sparse.kjt": "lightning_twod.core.kjt",
    "lightning_twod.sparse.outputs": "lightning_twod.core.outputs",
    "lightning_twod.sparse.validation": "lightning_twod.core.validation",
    "lightning_twod.strategy": "lightning_twod.strategies.strategy",
    "lightning_twod.topology": "lightning_twod.distributed",
}
#: Old package path -> its new name; every module below it moved with it.
RENAMED = {"lightning_twod.integration": "lightning_twod.strategies", "lightning_twod.cluster": "lightning_twod.hardware"}


def new_path(fullname: str) -> str | None:
    """Where the module of the old path ``fullname`` lives now, or None if it did not move."""
    if fullname in MOVED:
        return MOVED[fullname]
    for old, new in RENAMED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the new module for an old path and hands that module back under the old name."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if new_path(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(new_path(spec.name))
        spec.loader_state = module.__spec__  # the import machinery overwrites __spec__ with the old path's
        return module

    def exec_module(self, module: Any) -> None:
        """The module has run already under its new name: only its own ``__spec__`` is put back."""
        module.__spec__ = module.__spec__.loader_state


def install_aliases() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        # first: below a renamed package the path finder would load a second copy of a module, by its old name
        sys.meta_path.insert(0, _MovedFinder())
