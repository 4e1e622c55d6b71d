"""``fabric.clip_gradients`` is refused by ``TwoDSparseFabricStrategy``, as the Trainer refuses
``gradient_clip_val``: it would clip the dense gradients only and leave the embedding rows unclipped."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod import TwoDSparseFabricStrategy


@pytest.mark.parametrize("clipping", [dict(max_norm=1e-3), dict(clip_val=1e-3)])
def test_fabric_clip_gradients_is_refused_naming_the_fix(clipping):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=TwoDSparseFabricStrategy(shard_group_size=1))
    layer = torch.nn.Linear(3, 1)
    layer(torch.ones(2, 3)).sum().backward()
    gradient = layer.weight.grad.clone()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(MisconfigurationException,
                       match=r"^TwoDSparseFabricStrategy: gradient clipping would clip only the dense parameters.*"
                             r"remove fabric\.clip_gradients"):
        fabric.clip_gradients(layer, optimizer, **clipping)
    assert torch.equal(layer.weight.grad, gradient)  # nothing clipped before the refusal
