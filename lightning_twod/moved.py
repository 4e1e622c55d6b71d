"""Old module paths of the public names, kept importable after the modules moved into their layers.

``import lightning_twod.callbacks`` (or ``class_path: lightning_twod.callbacks.TrafficMonitor`` in a
config) still works: a finder answers each old path with the module that lives at the new one (the
same module object, so ``isinstance`` and monkeypatching see one module). A module that was split
is answered by the part that holds its documented names: ``lightning_twod.links`` by ``cluster.probe``
(``measure``), ``lightning_twod.topology`` by the ``distributed`` package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

#: Old module path -> where the module lives now.
MOVED = {
    "lightning_twod.callbacks": "lightning_twod.integration.callbacks",
    "lightning_twod.checkpoint_format": "lightning_twod.checkpoint.format",
    "lightning_twod.consensus": "lightning_twod.distributed.consensus",
    "lightning_twod.demo": "lightning_twod.cli.demo",
    "lightning_twod.emulation": "lightning_twod.testing.emulator",
    "lightning_twod.engine": "lightning_twod.integration.engine",
    "lightning_twod.even_batches": "lightning_twod.integration.even_batches",
    "lightning_twod.fabric": "lightning_twod.integration.fabric",
    "lightning_twod.launcher": "lightning_twod.integration.launcher",
    "lightning_twod.links": "lightning_twod.cluster.probe",
    "lightning_twod.lookahead": "lightning_twod.integration.lookahead",
    "lightning_twod.machine": "lightning_twod.cluster.machine",
    "lightning_twod.shards": "lightning_twod.core.shards",
    "lightning_twod.sparse.comm": "lightning_twod.distributed.comm",
    "lightning_twod.sparse.features": "lightning_twod.core.features",
    "lightning_twod.sparse.kjt": "lightning_twod.core.kjt",
    "lightning_twod.sparse.outputs": "lightning_twod.core.outputs",
    "lightning_twod.sparse.validation": "lightning_twod.core.validation",
    "lightning_twod.strategy": "lightning_twod.integration.strategy",
    "lightning_twod.topology": "lightning_twod.distributed",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the new module for an old path and hands that module back under the old name."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import machinery overwrites __spec__ with the old path's
        return module

    def exec_module(self, module: Any) -> None:
        """The module has run already under its new name: only its own ``__spec__`` is put back."""
        module.__spec__ = module.__spec__.loader_state


def install_aliases() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
