"""A replica round of the Adam family's state on two gloo processes (the copies of one replica group):
every state of a touched row is averaged; on the bf16 and int8 wires the weights and the first moment
travel as rounded changes, the second moment and the step count as fp32 values, so that the step stays
a count and the second moment never goes below zero."""

from __future__ import annotations

import pytest
import torch

from lightning_twod.replication import ReplicaReducer, ReplicatedKernel
from tests.helpers.distributed import run_distributed
from tests.helpers.replication_cases import look_up, make_kernel

ROWS = [1, 2]  # shard 0's rows both copies change
V_ROW = 3  # a row whose second moment both copies drop from 1.005 to 0: bf16 would round the change past it


def _worker(rank: int, world_size: int, optimizer: str, sync_dtype: str, overlap: bool) -> dict:
    import torch.distributed as dist

    kernel = make_kernel(optimizer=optimizer)
    state = kernel.shard_states()[0]
    with torch.no_grad():
        state["momentum2"][V_ROW] = 1.005
        state["step"].copy_(torch.arange(state["step"].numel(), dtype=torch.float32))
    reducer = ReplicaReducer([ReplicatedKernel(kernel, dist.group.WORLD, [0, 1])], sync_dtype)
    start = {"weight": kernel.weights()[0].clone(), **{n: t.clone() for n, t in state.items()}}
    look_up(kernel, [[*ROWS, V_ROW], [], []])
    with torch.no_grad():  # as a step would: each copy its own change
        for r in ROWS:
            kernel.weights()[0][r] += 0.01 * (rank + 1) * (r + 1)
            state["momentum1"][r] -= 0.003 * (rank + 1)
            state["momentum2"][r] *= 0.9 + 0.05 * rank
            state["step"][r] += 1 + rank  # copy 1 touched the row on two steps, copy 0 on one
        state["momentum2"][V_ROW] = 0.0
    changed = {"weight": kernel.weights()[0].clone(), **{n: t.clone() for n, t in state.items()}}
    if overlap:
        reducer.launch()
        reducer.finish()
        reducer.reduce()  # a drain
    else:
        reducer.reduce()
    after = {"weight": kernel.weights()[0].clone(), **{n: t.clone() for n, t in state.items()}}
    copies = {}
    for name, tensor in changed.items():
        both = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(both, tensor)
        copies[name] = [t.numpy().copy() for t in both]
    return {"start": {n: t.numpy().copy() for n, t in start.items()}, "copies": copies,
            "after": {n: t.numpy().copy() for n, t in after.items()}}


@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adam"])
@pytest.mark.parametrize("sync_dtype, overlap", [("bf16", False), ("bf16", True), ("int8", False)])
def test_exact_states_travel_in_fp32_on_a_rounding_wire(optimizer, sync_dtype, overlap):
    results = run_distributed(_worker, 2, optimizer, sync_dtype, overlap, timeout=120)
    for name in results[0]["after"]:
        assert (results[0]["after"][name] == results[1]["after"][name]).all(), f"{name}: copies differ"
    after = {n: torch.from_numpy(a) for n, a in results[0]["after"].items()}
    copies = {n: [torch.from_numpy(c) for c in pair] for n, pair in results[0]["copies"].items()}
    start = {n: torch.from_numpy(s) for n, s in results[0]["start"].items()}
    for name in ("momentum2", "step"):  # the fp32 mean, exactly
        assert torch.equal(after[name], (copies[name][0] + copies[name][1]) / 2), name
    assert (after["momentum2"][V_ROW] == 0.0).all()  # bf16: 1.005 + round(-1.005) = -0.0028, sqrt(v) NaN
    assert (after["step"][ROWS] == start["step"][ROWS] + 1.5).all()  # the replicas' mean count
    for name in ("weight", "momentum1"):  # rounded changes: near the mean, not it
        mean = (copies[name][0] + copies[name][1]) / 2
        torch.testing.assert_close(after[name], mean, atol=2e-4 if sync_dtype == "bf16" else 1e-3, rtol=0)
        if sync_dtype == "bf16":
            assert not torch.equal(after[name][ROWS], mean[ROWS]), f"{name}: the wire did not round"
