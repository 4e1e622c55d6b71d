"""Old module paths of the public names still import, as the very module that lives at the new path."""

import importlib

import pytest

import lightning_twod
from lightning_twod.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__.name == MOVED[old]  # the alias does not rename the module


@pytest.mark.parametrize("dotted", [
    "lightning_twod.topology.destroy_process_groups_at_exit",  # docs/api.md, docs/faq.md
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
