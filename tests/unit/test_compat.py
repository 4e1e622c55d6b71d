"""Old module paths of the public names still import, as the very module that lives at the new path."""

import ast
import importlib
from pathlib import Path

import pytest

import lightning_twod
from lightning_twod._compat import MOVED, RENAMED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__.name == MOVED[old]  # the alias does not rename the module


@pytest.mark.parametrize("old, new", [
    ("lightning_twod.integration", "lightning_twod.strategies"),
    ("lightning_twod.integration.callbacks", "lightning_twod.strategies.callbacks"),  # class_path in older configs
    ("lightning_twod.integration.strategy", "lightning_twod.strategies.strategy"),
    ("lightning_twod.cluster.probe", "lightning_twod.hardware.probe"),
])
def test_a_renamed_package_answers_every_module_below_it(old, new):
    assert any(old == o or old.startswith(o + ".") for o in RENAMED)
    module = importlib.import_module(old)
    assert module is importlib.import_module(new) and module.__spec__.name == new


@pytest.mark.parametrize("dotted", [
    "lightning_twod.integration.callbacks.PredictionWriter",
    "lightning_twod.topology.destroy_process_groups_at_exit",  # docs/api.md
    "lightning_twod.topology.SparseParallelDims",
    "lightning_twod.callbacks.TrafficMonitor",  # class_path in configs written before the move
    "lightning_twod.callbacks.PredictionWriter",
    "lightning_twod.links.measure",  # docs/planner.md
    "lightning_twod.shards.place_tables",
    "lightning_twod.sparse.features.SparseFeatures",
    "lightning_twod.strategy.TwoDSparseStrategy",
    "lightning_twod.fabric.TwoDSparseFabricStrategy",
    "lightning_twod.emulation.MeshEmulator",
])
def test_documented_names_at_old_paths(dotted):
    module, name = dotted.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("name", lightning_twod.__all__)
def test_public_names_load_on_first_use(name):
    value = getattr(lightning_twod, name)
    assert value.__name__ == name
    assert name in dir(lightning_twod)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'TwoDSparse'"):
        lightning_twod.TwoDSparse  # noqa: B018


def test_type_checkers_see_the_same_public_names():
    """The ``if TYPE_CHECKING:`` imports of ``lightning_twod/__init__.py`` match ``_PUBLIC``."""
    tree = ast.parse(Path(lightning_twod.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in block.body for alias in node.names}
    assert seen.keys() == lightning_twod._PUBLIC.keys()
    for name, module in seen.items():
        assert getattr(importlib.import_module(module), name) is getattr(lightning_twod, name)
