"""The dense optimizer state of a DDP checkpoint maps onto the dense parameters by model order, and
what cannot be mapped is refused (the resumes: ``tests/system/test_foreign_checkpoint.py``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_twod.checkpoint.optimizer import dense_optimizer_state


# ----------------------------------------------------------------------------- the mapping alone
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(2, 2)
        self.table = nn.Embedding(5, 2)
        self.head = nn.Linear(2, 1)


def _adam_state(params) -> dict:
    optimizer = torch.optim.Adam(params, lr=0.1)
    loss = sum(p.sum() for p in optimizer.param_groups[0]["params"])
    loss.backward()
    optimizer.step()
    return optimizer.state_dict()


def test_dense_optimizer_state_maps_by_model_order_and_refuses_what_it_cannot_map():
    model = Tiny()
    unsharded = [(name, name.startswith("table")) for name, _ in model.named_parameters()]
    saved = _adam_state(list(model.parameters()))
    dense = [p for name, p in model.named_parameters() if not name.startswith("table")]
    del model.table  # as the strategy's swap leaves it: the table is no parameter any more
    mapped, why = dense_optimizer_state(saved, torch.optim.Adam(dense, lr=0.1), unsharded, model)
    assert why == "" and mapped is not None
    assert sorted(mapped["state"]) == [0, 1, 2, 3]
    assert torch.equal(mapped["state"][2]["exp_avg"], saved["state"][3]["exp_avg"])  # head.weight: 3 -> 2

    two_groups = torch.optim.Adam([{"params": dense[:2]}, {"params": dense[2:]}], lr=0.1)
    mapped, why = dense_optimizer_state(saved, two_groups, unsharded, model)
    assert mapped is None and "1 parameter group(s) in the checkpoint, 2 here" in why
