"""``strategy="twod_sparse"`` is known to the Trainer and to Fabric whichever is imported first,
while ``import lightning_twod`` itself imports neither torch nor Lightning (a fresh interpreter each)."""

import subprocess
import sys

import pytest

CHECK = """
import sys
{first}
{second}
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from lightning_twod import TwoDSparseFabricStrategy, TwoDSparseStrategy
from lightning_twod.strategies.registration import STRATEGY_NAMES
for name, start_method, _ in STRATEGY_NAMES:
    assert name in StrategyRegistry and name in STRATEGY_REGISTRY, name
    trainer_strategy = StrategyRegistry.get(name)
    assert type(trainer_strategy) is TwoDSparseStrategy and trainer_strategy._start_method == start_method
    assert type(STRATEGY_REGISTRY.get(name)) is TwoDSparseFabricStrategy
trainer = Trainer(strategy="twod_sparse_spawn", accelerator="cpu", devices=2, logger=False)
assert isinstance(trainer.strategy, TwoDSparseStrategy)
fabric = Fabric(strategy="twod_sparse_spawn", accelerator="cpu", devices=2)
assert isinstance(fabric.strategy, TwoDSparseFabricStrategy)
import importlib, lightning_twod
importlib.reload(lightning_twod)  # importing again is harmless
print("ok")
"""

TWOD = "import lightning_twod\nassert not {'torch', 'lightning'} & set(sys.modules), sorted(sys.modules)"
LIGHTNING = "import lightning.pytorch, lightning.fabric"


@pytest.mark.parametrize("first, second", [(TWOD, LIGHTNING), (LIGHTNING, "import lightning_twod")],
                         ids=["lightning_twod_first", "lightning_first"])
def test_names_registered_whichever_is_imported_first(first, second):
    done = subprocess.run([sys.executable, "-c", CHECK.format(first=first, second=second)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
