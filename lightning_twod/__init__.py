"""lightning-twod: 2D sparse parallelism for recommendation models, as a Lightning strategy.

``import lightning_twod`` registers ``strategy="twod_sparse"`` (and ``"twod_sparse_spawn"``,
``"twod_sparse_notebook"``) with Lightning's Trainer and with Fabric; importing it again is harmless.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_twod.checkpoint import consolidate
from lightning_twod.fabric import TwoDSparseFabricStrategy
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.features import SparseFeatures
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingCollection, EmbeddingTableConfig
from lightning_twod.sparse.outputs import JaggedEmbeddings, PooledEmbeddings
from lightning_twod.strategy import TwoDSparseStrategy
from lightning_twod.topology import SparseParallelDims

TwoDSparseStrategy.register_strategies(StrategyRegistry)
TwoDSparseFabricStrategy.register_strategies(FABRIC_STRATEGIES)

__version__ = "0.1.0"

__all__ = [
    "consolidate",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "EmbeddingTableConfig",
    "JaggedEmbeddings",
    "PooledEmbeddings",
    "SparseFeatures",
    "SparseOptimizerConfig",
    "SparseParallelDims",
    "TwoDSparseFabricStrategy",
    "TwoDSparseStrategy",
]
