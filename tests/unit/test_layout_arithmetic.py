"""The momentum scale derived per table kind (``M`` sharded, ``W`` data-parallel) keeps a row's
accumulator at the 1D rate (the real fits against the emulator: ``tests/system/test_layout_arithmetic.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures
from lightning_twod.sparse.optimizers import layout_optimizer
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator


# ----------------------------------------------------------------------------- accumulator rate
class OneRowNet(nn.Module):
    """One sharded and one data-parallel table of 8 rows; a sample reads row ``id`` of both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sparse = EmbeddingBagCollection([EmbeddingTableConfig("sharded", 8, 4, ["a"]),
                                              EmbeddingTableConfig("replicated", 8, 4, ["b"])])
        self.head = nn.Linear(8, 1)

    def loss(self, batch: dict) -> torch.Tensor:
        pooled = self.sparse(batch["sparse"]).values()
        return (self.head(pooled).squeeze(1) - batch["y"]).pow(2).mean()


def _one_row_batches(world: int, step: int, ranks: int) -> list[dict]:
    """Step ``step`` of a ``world``-rank run split over ``ranks`` local batches (1: the global batch).

    Row 7 is read by one sample of one rank per step (the rank cycles); the others read rows 0..6.
    """
    gen = torch.Generator().manual_seed(step)
    ids, targets = [], []
    for rank in range(world):
        rank_ids = torch.randint(0, 7, (4,), generator=gen)
        if rank == step % world:
            rank_ids[0] = 7
        ids.append(rank_ids.tolist())
        targets.append(torch.randn(4, generator=gen))
    per = world // ranks
    batches = []
    for part in range(ranks):
        chosen = [i for r in range(part * per, (part + 1) * per) for i in ids[r]]
        batches.append({"sparse": SparseFeatures.from_dict({"a": [[i] for i in chosen], "b": [[i] for i in chosen]}),
                        "y": torch.cat(targets[part * per:(part + 1) * per])})
    return batches


def _row_accumulator(world: int, group: int, steps: int, momentum_scale="auto", ranks: int | None = None) -> dict:
    """Per table kind, ``v / c`` of row 7 after ``steps`` steps on the emulated layout
    (``ranks=1``: one process on the global batches, the 1D reference)."""
    ranks = ranks or world
    net = OneRowNet()
    layout = EmulatedLayout(ranks, group, data_parallel=("replicated",))
    configs = [layout_optimizer("momentum_rowwise_adagrad", 0.001, 1e-8, momentum_scale, data_parallel=dp,
                                world_size=ranks, shard_group_size=group, sync_mode="weights") for dp in (False, True)]
    emulator = MeshEmulator(net, layout, configs[0], lambda model, batch: model.loss(batch),
                            lambda params: torch.optim.SGD(params, lr=0.0), data_parallel_sparse=configs[1])
    for step in range(steps):
        emulator.step(_one_row_batches(world, step, ranks))
    return {kind: float(emulator.states[f"sparse.embedding_bags.{kind}.weight"]["momentum1"][0][7]) / config.momentum_scale
            for kind, config in (("sharded", configs[0]), ("replicated", configs[1]))}


@pytest.mark.parametrize(("world", "group"), [(4, 2), (4, 4), (4, 1), (8, 2)])
def test_layout_momentum_scale_keeps_the_1d_accumulator_rate(world, group):
    one_d = _row_accumulator(world, 1, 50, ranks=1)
    layout = _row_accumulator(world, group, 50)
    for kind in ("sharded", "replicated"):
        assert one_d[kind] > 0
        ratio = layout[kind] / one_d[kind]
        assert abs(ratio - 1) < 0.05, f"{kind}: v/c after 50 steps is {ratio:.3f} x the 1D accumulator"
    if group > 1:  # the replica count alone, as the data-parallel tables' scale, runs S times too fast
        replicas = float(world // group)
        wrong = _row_accumulator(world, group, 50, momentum_scale=replicas)
        assert wrong["replicated"] / one_d["replicated"] > 1.5
