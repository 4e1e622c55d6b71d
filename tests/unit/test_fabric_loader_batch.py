"""``TwoDSparseFabricStrategy`` keeps of the first loader set up only its ``batch_size`` (the planner's
batch), not the loader: a loader may hold a whole dataset in memory for the strategy's lifetime."""

from __future__ import annotations

import gc
import weakref

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, TwoDSparseFabricStrategy
from lightning_twod.planner.links import resolve_links


def test_the_first_loader_gives_its_batch_and_is_not_kept():
    strategy = TwoDSparseFabricStrategy(shard_group_size=1)
    Fabric(accelerator="cpu", devices=1, strategy=strategy)  # sets the strategy's devices
    dataset = TensorDataset(torch.zeros(64, 3))
    watched = weakref.ref(dataset)
    loader = strategy.process_dataloader(DataLoader(dataset, batch_size=6))  # what fabric.setup_dataloaders calls
    del loader, dataset
    gc.collect()
    assert watched() is None, "the strategy keeps the first loader (and its dataset) alive"
    module = torch.nn.Sequential(EmbeddingBagCollection([EmbeddingTableConfig("t", 100, 8, ["f"])]))
    plan = strategy.plan_layout(module, budget=2**30, links=resolve_links("h100"))
    assert plan.plan.report.batch_size == 6  # the loader's batch, though the loader is gone
