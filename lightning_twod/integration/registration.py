"""Registers ``strategy="twod_sparse"`` (and its ``_spawn`` / ``_notebook`` variants) with Lightning and Fabric.

``import lightning_twod`` must not import Lightning (the planner and ``lightning-twod --version``
run without it), yet the names must be known to the Trainer however the imports are ordered.
:func:`install` registers at once where Lightning's strategy registries are already imported, and
otherwise right after Python finishes importing them. A registered name builds its strategy
through a factory that imports the strategy class on first use.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

#: The registered strategy names (Trainer and Fabric alike): name, start method, what launches.
STRATEGY_NAMES = (
    ("twod_sparse", "popen", "subprocess launcher; also under torchrun and SLURM"),
    ("twod_sparse_spawn", "spawn", "spawned processes"),
    ("twod_sparse_notebook", "fork", "forked processes, usable inside Jupyter"),
)


def register_names(strategy: Callable[..., Any], registry: Any) -> None:
    """Register ``strategy`` (a class or a factory) under ``STRATEGY_NAMES``; names already there stay."""
    for name, start_method, what in STRATEGY_NAMES:
        if name not in registry:
            registry.register(name, strategy, description=f"2D sparse parallelism ({what})",
                              start_method=start_method)


def _trainer_strategy(**kwargs: Any) -> Any:
    from lightning_twod.integration.strategy import TwoDSparseStrategy

    return TwoDSparseStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any) -> Any:
    from lightning_twod.integration.fabric import TwoDSparseFabricStrategy

    return TwoDSparseFabricStrategy(**kwargs)


def _register_trainer(module: Any) -> None:
    register_names(_trainer_strategy, module.StrategyRegistry)


def _register_fabric(module: Any) -> None:
    register_names(_fabric_strategy, module.STRATEGY_REGISTRY)


#: Lightning module holding a registry -> what registers our names in it.
_REGISTRIES: dict[str, Callable[[Any], None]] = {
    "lightning.pytorch.strategies": _register_trainer,
    "lightning.fabric.strategies": _register_fabric,
}


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds a registry module through the other finders and registers once it has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        register = _REGISTRIES.get(fullname)
        if register is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenRegister(spec.loader, register)
                return spec
        return None


class _ThenRegister(importlib.abc.Loader):
    """``loader``, followed by ``register(module)`` once the module has run."""

    def __init__(self, loader: importlib.abc.Loader, register: Callable[[Any], None]) -> None:
        self.loader = loader
        self.register = register

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.register(module)


def install() -> None:
    """Register now in registries already imported; register the others when they are imported."""
    for name, register in _REGISTRIES.items():
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "StrategyRegistry" if "pytorch" in name else "STRATEGY_REGISTRY"):
            register(module)
    if not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
