"""``fabric.clip_gradients`` is refused by ``TwoDSparseFabricStrategy``, and a LightningModule's own
``self.clip_gradients`` by ``TwoDSparseStrategy``, as the Trainer refuses ``gradient_clip_val``: each
would clip the dense gradients only and leave the embedding rows unclipped."""

from __future__ import annotations

import lightning.pytorch
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_twod import (
    EmbeddingBagCollection,
    EmbeddingTableConfig,
    SparseFeatures,
    TwoDSparseFabricStrategy,
    TwoDSparseStrategy,
)


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


class _ClipsByHand(lightning.pytorch.LightningModule):
    """Manual optimization that clips with ``self.clip_gradients``: the precision plugin's path."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.sparse = EmbeddingBagCollection([EmbeddingTableConfig("t", 8, 4, ["f"])])
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        features = SparseFeatures(["f"], torch.tensor([1, 2]), torch.tensor([1, 1]))
        self.manual_backward(self.layer(self.sparse(features).values()).sum())
        self.clip_gradients(optimizer, gradient_clip_val=1e-3)
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(4), batch_size=2)


def test_the_trainer_refuses_clip_gradients_of_the_module_naming_the_fix():
    module = _ClipsByHand()
    trainer = lightning.pytorch.Trainer(accelerator="cpu", devices=1, strategy=TwoDSparseStrategy(), max_steps=1,
                                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                        enable_model_summary=False)
    with pytest.raises(MisconfigurationException, match=r"clip only the dense parameters.*remove self\.clip_gradients"):
        trainer.fit(module)
