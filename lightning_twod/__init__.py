"""lightning-twod: 2D sparse parallelism for recommendation models, as a Lightning strategy.

``import lightning_twod`` registers ``strategy="twod_sparse"`` (and ``"twod_sparse_spawn"``,
``"twod_sparse_notebook"``) with Lightning's Trainer and with Fabric; importing it again is harmless.
It imports neither Lightning nor torch itself: the public names below load on first use, so the
planner and ``lightning-twod --version`` start in a fraction of a second.

The packages, bottom layer first (a package imports only from the layers below it;
``tests/unit/test_layers.py`` checks it):

* ``core``: value types: features, outputs, shards and the mesh arithmetic (no process group);
* ``planner``: the pure planner and simulator (no torch);
* ``distributed``: process groups of the mesh, collectives, agreement across ranks;
* ``sparse``: sharded lookups: sharding types, input and output dist, kernels, optimizers, pipeline;
* ``replication``: the cross-group reduction that keeps the copies of a shard equal;
* ``hardware``: the links probe and the machine's memory, inputs of the planner;
* ``checkpoint``: distributed checkpoints, the safe reader, ``consolidate``;
* ``strategies``: the Lightning and Fabric strategies: options, engine, launcher, callbacks;
* ``metrics``, ``datasets``, ``models``: exact metrics, data modules and the DLRM;
* ``testing``: the single-process emulator, the tests' oracle;
* ``cli``: every command of ``lightning-twod``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_twod._compat import install_aliases
from lightning_twod.strategies import registration

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers see; at run time ``__getattr__`` loads each name on first use
    from lightning_twod.checkpoint import consolidate as consolidate
    from lightning_twod.core.features import SparseFeatures as SparseFeatures
    from lightning_twod.core.mesh import SparseParallelDims as SparseParallelDims
    from lightning_twod.core.outputs import JaggedEmbeddings as JaggedEmbeddings
    from lightning_twod.core.outputs import PooledEmbeddings as PooledEmbeddings
    from lightning_twod.sparse.modules import EmbeddingBagCollection as EmbeddingBagCollection
    from lightning_twod.sparse.modules import EmbeddingCollection as EmbeddingCollection
    from lightning_twod.sparse.modules import EmbeddingTableConfig as EmbeddingTableConfig
    from lightning_twod.sparse.optimizers import SparseOptimizerConfig as SparseOptimizerConfig
    from lightning_twod.strategies.fabric import TwoDSparseFabricStrategy as TwoDSparseFabricStrategy
    from lightning_twod.strategies.strategy import TwoDSparseStrategy as TwoDSparseStrategy

#: Public name -> the module that defines it.
_PUBLIC = {
    "consolidate": "lightning_twod.checkpoint.export",
    "EmbeddingBagCollection": "lightning_twod.sparse.modules",
    "EmbeddingCollection": "lightning_twod.sparse.modules",
    "EmbeddingTableConfig": "lightning_twod.sparse.modules",
    "JaggedEmbeddings": "lightning_twod.core.outputs",
    "PooledEmbeddings": "lightning_twod.core.outputs",
    "SparseFeatures": "lightning_twod.core.features",
    "SparseOptimizerConfig": "lightning_twod.sparse.optimizers",
    "SparseParallelDims": "lightning_twod.core.mesh",
    "TwoDSparseFabricStrategy": "lightning_twod.strategies.fabric",
    "TwoDSparseStrategy": "lightning_twod.strategies.strategy",
}

__all__ = sorted(_PUBLIC)

registration.install()
install_aliases()


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_twod' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
