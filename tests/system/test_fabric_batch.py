"""The batch a Fabric plan is made for: the first loader's, set up before ``fabric.setup``, where the
module has no ``batch_size``; a loader set up after a plan made for another batch is warned about
with the fix. Two gloo ranks posing as torchrun ranks (Fabric reuses their process group)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_twod import TwoDSparseFabricStrategy
from lightning_twod.strategies.planning import DEFAULT_PLANNER_BATCH
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

BATCH = 6


def _plan(world_size: int, loaders_first: bool, **options) -> dict:
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=TwoDSparseFabricStrategy(shard_group_size=2,
                                                                                             **options))
    fabric.launch()
    net = C.make_net("collection")  # a plain module: no batch_size of its own
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(C.ClickDataset(4 * BATCH * world_size), batch_size=BATCH, collate_fn=C.collate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if loaders_first:
            loader = fabric.setup_dataloaders(loader)
            model, optimizer = fabric.setup(net, optimizer)
        else:
            model, optimizer = fabric.setup(net, optimizer)
            loader = fabric.setup_dataloaders(loader)
    for batch in loader:  # it trains, whatever the order
        fabric.backward(F.binary_cross_entropy_with_logits(model(batch), batch["y"]))
        optimizer.step()
        optimizer.zero_grad()
    plan = fabric.strategy.sharding_plan
    return {"batch": plan.report.batch_size, "described": plan.describe(),
            "warnings": [str(w.message) for w in caught if "planner_batch_size" in str(w.message)]}


def _worker(rank: int, world_size: int, port: int) -> dict:
    C.as_external_rank(rank, world_size, port)
    return {"loaders first": _plan(world_size, True), "model first": _plan(world_size, False),
            "pinned batch": _plan(world_size, False, planner_batch_size=32)}


def test_the_fabric_plan_states_the_batch_of_the_loader_set_up_first():
    ranks = run_distributed(_worker, 2, C.free_port())
    first = ranks[0]["loaders first"]
    assert first["batch"] == BATCH and f"batch {BATCH} per rank" in first["described"]
    assert first["warnings"] == []
    late = ranks[0]["model first"]
    assert late["batch"] == DEFAULT_PLANNER_BATCH
    assert late["warnings"] == [f"TwoDSparseFabricStrategy: the plan was made at fabric.setup for batch "
                                f"{DEFAULT_PLANNER_BATCH} per rank, but the loader set up after it gives {BATCH}: call "
                                f"fabric.setup_dataloaders before fabric.setup, or give planner_batch_size={BATCH}"]
    assert ranks[1]["model first"]["warnings"] == [], "rank 0 alone warns"
    pinned = ranks[0]["pinned batch"]
    assert pinned["batch"] == 32 and pinned["warnings"] == [], "a batch the user gave is the plan's, unwarned"
