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
    from lightning_twod.strategies.strategy import TwoDSparseStrategy

    return TwoDSparseStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any) -> Any:
    from lightning_twod.strategies.fabric import TwoDSparseFabricStrategy

    return TwoDSparseFabricStrategy(**kwargs)


#: Lightning module -> the name of its strategy registry and the factory registered in it.
_REGISTRIES: dict[str, tuple[str, Callable[..., Any]]] = {
    "lightning.pytorch.strategies": ("StrategyRegistry", _trainer_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _fabric_strategy),
}


def _register_in(module: Any) -> None:
    """Register the names in the registry of ``module`` (one of ``_REGISTRIES``), if it has it yet."""
    attribute, factory = _REGISTRIES[module.__name__]
    registry = getattr(module, attribute, None)
    if registry is not None:
        register_names(factory, registry)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds a registry module through the other finders and registers once it has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _REGISTRIES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


class _ThenRegister(importlib.abc.Loader):
    """``loader``, followed by the registration once the module has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _register_in(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers: the loader's own
        return getattr(self.loader, name)


def install() -> None:
    """Register now in registries already imported; register the others when they are imported."""
    for name in _REGISTRIES:
        if name in sys.modules:
            _register_in(sys.modules[name])
    if not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
