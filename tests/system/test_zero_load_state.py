"""A ``ZeroRedundancyOptimizer`` state whose entries name no parameter of the model (a crafted or
foreign checkpoint) is refused by ``checkpoint.optimizer.load_state`` with the entry and the
checkpoint named, not a bare ``KeyError``. One gloo process (ZeRO needs a process group)."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_twod.checkpoint.optimizer import load_state, state_to_save
from tests.helpers.distributed import run_distributed


def _worker(rank: int, world_size: int) -> str:
    model = torch.nn.Linear(3, 1)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    state = state_to_save(model, optimizer)
    state["state"]["nope.weight"] = dict(state["state"]["weight"])
    try:
        load_state(model, optimizer, state, "ckpt/last.ckpt")
    except KeyError as err:
        return str(err)
    return "loaded"


def test_a_zero_state_for_an_unknown_parameter_is_refused_naming_it_and_the_checkpoint():
    message = run_distributed(_worker, 1)[0]
    assert "checkpoint ckpt/last.ckpt holds ZeroRedundancyOptimizer state for ['nope.weight']" in message, message
