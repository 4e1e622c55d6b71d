"""The cross-group reduction (``lightning_twod.replication``) on its own: row masks, the rounds'
arithmetic in fp32, bf16 and int8 (with its residuals), dense and sparse segments, bytes, and the
overlapped correction.

The distributed checks use two real gloo processes holding the two copies of one replica group;
each copy changes rows of two shards by hand (as an optimizer step would) and records them as a
lookup would.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_twod.core.reduction import CHUNK, GROWTH
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.replication import ReplicaReducer, ReplicatedKernel
from lightning_twod.sparse.kernels import ShardShape, TorchKernel
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.replication_cases import look_up, make_kernel


def _reduction_worker(rank: int, world_size: int, sync_dtype: str) -> dict:
    import torch.distributed as dist

    kernel = make_kernel()  # the same start on both copies
    counter = ByteCounter(rank, world_size)
    reducer = ReplicaReducer([ReplicatedKernel(kernel, dist.group.WORLD, [0, 1])], sync_dtype, counter)
    weights, states = kernel.weights(), kernel.optimizer_states()
    start = [w.clone() for w in weights] + [s.clone() for s in states]

    # a step: shard 0 rows {1, 2} on copy 0 and {2, 5} on copy 1; shard 1 all of its 8 rows
    rows = [[1, 2], list(range(8)), []] if rank == 0 else [[2, 5], list(range(8)), []]
    look_up(kernel, rows)
    with torch.no_grad():
        for r in rows[0]:
            weights[0][r] += 0.01 * (rank + 1) * (r + 1)
            states[0][r] += 0.5 * (rank + 1)
        weights[1] -= 0.003 * (rank + 1)
    changed = [w.clone() for w in weights] + [s.clone() for s in states]
    sent = reducer.reduce()
    after = [w.clone() for w in weights] + [s.clone() for s in states]
    kept = reducer.groups[0].residuals[0] if sync_dtype == "int8" else []  # per shard: (weights, state)
    residuals = [t.clone().squeeze(1) if t.shape[1] == 1 else t.clone() for column in zip(*kept) for t in column]
    gathered = []
    for tensor in changed:
        copies = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(copies, tensor)
        gathered.append(copies)
    payload = counter.by_name()["replica_sync"]

    # overlapped: launch, change a row on copy 0 meanwhile, then apply
    look_up(kernel, [[7], [], []])
    with torch.no_grad():
        weights[0][7] += 0.02 * (rank + 1)
    launched = weights[0][7].clone()
    reducer.launch()
    look_up(kernel, [[7] if rank == 0 else [], [], []])
    with torch.no_grad():
        if rank == 0:
            weights[0][7] += 1.0  # copy 0's own update while the round is in flight
    in_flight = len(reducer.in_flight)
    reducer.finish()
    overlapped = weights[0][7].clone()
    mean_7 = [torch.empty_like(launched) for _ in range(2)]
    dist.all_gather(mean_7, launched)
    reducer.reduce()  # what a drain does: now every copy is identical
    drained = [w.clone() for w in weights] + [s.clone() for s in states]
    result = dict(start=start, changed=gathered, after=after, sent=sent, payload=payload, in_flight=in_flight,
                  overlapped=overlapped, launched=mean_7, drained=drained, residuals=residuals)
    return _as_numpy(result)  # tensors would travel through shared memory that an exiting child takes along


def _as_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    if isinstance(value, dict):
        return {k: _as_numpy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_numpy(v) for v in value]
    return value


def _as_torch(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _as_torch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_torch(v) for v in value]
    return value


def _run(sync_dtype: str) -> list[dict]:
    return [_as_torch(r) for r in run_distributed(_reduction_worker, 2, sync_dtype, timeout=120)]


def _int8_round(start: torch.Tensor, copies: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The int8 round of two copies with no residual yet, written out: (new value, residuals).
    Rows are the first dimension; a 1-D tensor (row-wise state) has one value a row."""
    rows = (lambda t: t) if start.dim() == 2 else (lambda t: t.unsqueeze(1))
    changes = [rows(c - start) for c in copies]
    largest = torch.maximum(changes[0].abs().amax(dim=1), changes[1].abs().amax(dim=1))
    # the scale: the smallest quarter power of two 2^(k/4) >= the largest change of the row
    scale = torch.exp2(torch.ceil(torch.log2(largest) * 4) / 4).unsqueeze(1)
    used = largest.unsqueeze(1) > 0
    step, inverse = torch.where(used, scale / 63, 0.0), torch.where(used, 63 / scale, 0.0)
    levels = [torch.round(c * inverse) for c in changes]  # 63 levels either side: two copies' sum fits int8
    new = (levels[0] + levels[1]) * (step / 2) + rows(start)
    return new.view_as(start), [(c - q * step).view_as(start) for c, q in zip(changes, levels, strict=True)]


def _expected(start: torch.Tensor, copies: list[torch.Tensor], sync_dtype: str) -> torch.Tensor:
    if sync_dtype == "fp32":
        return (copies[0] + copies[1]) / 2
    if sync_dtype == "int8":
        return _int8_round(start, copies)[0]
    changes = [(c - start).to(torch.bfloat16) for c in copies]
    return start + (changes[0] + changes[1]).float() / 2


def _applied(start: torch.Tensor, copies: list[torch.Tensor], copy: int) -> torch.Tensor:
    """Copy ``copy`` after an overlapped bf16 round that it did not change in flight: its values plus the
    mean change less its own sent change (what bf16 rounding kept off the wire stays with the copy)."""
    sent = [(c - start).to(torch.bfloat16) for c in copies]
    return copies[copy] + ((sent[0] + sent[1]).float() / 2 - sent[copy].float())


def _check_round(results: list[dict], sync_dtype: str) -> None:
    zero, one = results
    for index, start in enumerate(zero["start"]):
        want = _expected(start, zero["changed"][index], sync_dtype)
        for result in results:
            assert torch.equal(result["after"][index], want), f"tensor {index}: not the {sync_dtype} mean"
        assert torch.equal(zero["after"][index], one["after"][index]), "copies differ after the round"
    untouched = [r for r in range(40) if r not in (1, 2, 5)]
    assert torch.equal(zero["after"][0][untouched], zero["start"][0][untouched]), "untouched rows unchanged"
    assert zero["sent"] == 3 + 8, "shard 0: its 3 touched rows; shard 1: whole (all 8 rows touched)"


def test_fp32_round_is_the_mean_of_the_touched_rows():
    results = _run("fp32")
    _check_round(results, "fp32")
    # mask: 48 rows -> 6 bytes; payload: (3 rows x (4 + 1) + 8 rows x (2 + 1)) fp32, and one fp32 that says
    # whether this copy's whole shard (shard 1) is finite; a 2-rank ring sends it once
    assert results[0]["payload"] == 6 + (3 * 5 + 8 * 3 + 1) * 4


def test_bf16_round_sends_half_and_adds_the_mean_change_to_the_reference():
    results = _run("bf16")
    _check_round(results, "bf16")
    assert results[0]["payload"] == 6 + (3 * 5 + 8 * 3) * 2


def test_int8_round_sends_levels_and_scales_and_keeps_what_rounding_dropped():
    results = _run("int8")
    _check_round(results, "int8")
    zero = results[0]
    for index, start in enumerate(zero["start"]):
        _, residuals = _int8_round(start, zero["changed"][index])
        for rank, result in enumerate(results):
            assert torch.equal(result["residuals"][index], residuals[rank]), f"tensor {index}: copy {rank}'s residual"
    changes = [copy - zero["start"][0] for copy in zero["changed"][0]]
    largest = torch.maximum(*(c.abs().amax(dim=1, keepdim=True) for c in changes))
    assert (zero["residuals"][0].abs() <= largest / 63 + 1e-7).all(), "rounding drops at most half a level (< 2x largest / 63)"
    assert zero["residuals"][0][[1, 2, 5]].abs().sum() > 0, "something was dropped, and kept"
    # int8 levels of (3 rows x (4 + 1) + 8 rows x (2 + 1)), an int8 exponent per row of weights and of state
    assert zero["payload"] == 6 + (3 * 5 + 8 * 3) + (3 + 8) * 2


def test_overlapped_round_corrects_rows_changed_in_flight_and_drains_to_identical_copies():
    for sync_dtype in ("fp32", "bf16", "int8"):
        zero, one = _run(sync_dtype)
        assert zero["in_flight"] == one["in_flight"] == 1, "launch() returned with the round in flight"
        launched = [row.unsqueeze(0) for row in zero["launched"]]
        reference = zero["after"][0][7].unsqueeze(0)
        mean = _expected(reference, launched, sync_dtype).squeeze(0)
        if sync_dtype == "bf16":  # each copy adds (mean change - its sent change): what rounding kept off stays
            sent = [(copy - reference).to(torch.bfloat16).float().squeeze(0) for copy in launched]
            change = (mean - reference).squeeze(0)
            assert torch.equal(one["overlapped"], launched[1].squeeze(0) + (change - sent[1]))
            torch.testing.assert_close(zero["overlapped"], launched[0].squeeze(0) + 1.0 + (change - sent[0]),
                                       atol=1e-6, rtol=0)
            # the residual is what bf16 rounding dropped: at most 2^-9 of the change sent
            assert (one["overlapped"] - mean).abs().max() <= 2**-8 * (launched[1] - reference).abs().max()
            assert not torch.equal(one["overlapped"], mean), "a residual the drain must remove"
        else:  # copy 1 did not change row 7 in flight: it takes the mean; copy 0 keeps its own update on top
            assert torch.equal(one["overlapped"], mean)
            torch.testing.assert_close(zero["overlapped"], mean + 1.0, atol=1e-6, rtol=0)
        for a, b in zip(zero["drained"], one["drained"], strict=True):
            assert torch.equal(a, b), f"{sync_dtype}: copies differ after the drain"


def _whole_shard_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    kernel = TorchKernel([ShardShape(20, 4)], [0], pooled=True, optimizer=SparseOptimizerConfig("rowwise_adagrad"))
    torch.manual_seed(0)
    kernel.weights()[0].copy_(torch.randn(20, 4))
    reducer = ReplicaReducer([ReplicatedKernel(kernel, dist.group.WORLD, [0, 1])], "int8")
    weight, generator = kernel.weights()[0], torch.Generator().manual_seed(rank)
    residual = reducer.groups[0].residuals[0][0][0]
    kept = []
    for touched in (range(20), range(19)):  # all rows, then all but row 19: both rounds take the shard whole
        look_up(kernel, [list(touched)])
        with torch.no_grad():
            weight[list(touched)] += 0.01 * torch.randn(len(touched), 4, generator=generator)
        reducer.reduce()
        kept.append((residual[19].clone(), weight[19].clone()))
    return _as_numpy(dict(kept=kept, weight=weight.clone(), residual=residual.clone()))


def test_int8_whole_shard_keeps_the_residual_of_rows_no_copy_touched():
    zero, one = (_as_torch(r) for r in run_distributed(_whole_shard_worker, 2, timeout=120))
    assert torch.equal(zero["weight"], one["weight"]), "copies differ after the rounds"
    for result in (zero, one):
        (residual_1, weight_1), (residual_2, weight_2) = result["kept"]
        assert residual_1.abs().sum() > 0, "round 1 dropped something from row 19"
        assert torch.equal(residual_2, residual_1), "row 19 was not touched in round 2: its residual waits"
        assert torch.equal(weight_2, weight_1), "row 19 was not touched in round 2: its value stays"
    assert zero["residual"][:19].abs().sum() > 0 and not torch.equal(zero["residual"], one["residual"])


LARGE = [ShardShape(20_000, 32), ShardShape(9_000, 32)]  # more than one chunk of a round (rounds.CHUNK) each
IN_FLIGHT = [(0, 0), (0, 15_000), (1, 8_999)]  # (shard, row) copy 0 changes while a round is in flight


def _large_round_worker(rank: int, world_size: int, sync_dtype: str, overlap: bool) -> dict:
    import torch.distributed as dist

    kernel = make_kernel(LARGE, [0, 1])
    reducer = ReplicaReducer([ReplicatedKernel(kernel, dist.group.WORLD, [0, 1])], sync_dtype)
    weights, states = kernel.weights(), kernel.optimizer_states()
    start = [t.clone() for t in (*weights, *states)]
    # shard 0: copy 0 the even rows, copy 1 rows 0-9,999 (3/4 of it: gathered); shard 1: all (whole)
    rows = torch.arange(0, 20_000, 2) if rank == 0 else torch.arange(10_000)
    generator = torch.Generator().manual_seed(rank)
    look_up(kernel, [rows.tolist(), list(range(9_000))])
    with torch.no_grad():
        weights[0][rows] += 0.01 * torch.randn(rows.numel(), 32, generator=generator)
        states[0][rows] += torch.rand(rows.numel(), generator=generator)
        weights[1] += 0.01 * torch.randn(9_000, 32, generator=generator)
        states[1] += torch.rand(9_000, generator=generator)
    changed = []
    for tensor in (*weights, *states):
        copies = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(copies, tensor)
        changed.append(copies)
    if overlap:
        reducer.launch()
        look_up(kernel, [[0, 15_000], [8_999]] if rank == 0 else [[], []])
        with torch.no_grad():
            for shard, row in IN_FLIGHT if rank == 0 else []:
                weights[shard][row] += 1.0
        reducer.finish()
    else:
        reducer.reduce()
    after = [t.clone() for t in (*weights, *states)]
    buffers = {name: str(b.dtype) for name, b in reducer.groups[0].workspace.buffers.items()}
    held = reducer.memory()
    reducer.reduce()
    drained = [t.clone() for t in (*weights, *states)]
    return _as_numpy(dict(start=start, changed=changed, after=after, drained=drained, buffers=buffers, held=held))


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
@pytest.mark.parametrize("sync_dtype", ["fp32", "bf16", "int8"])
def test_a_round_larger_than_a_chunk_is_exact_in_every_chunk(sync_dtype, overlap):
    zero, one = (_as_torch(r) for r in run_distributed(_large_round_worker, 2, sync_dtype, overlap, timeout=120))
    wanted = _applied if overlap and sync_dtype == "bf16" else (lambda start, copies, _: _expected(start, copies, sync_dtype))
    for index, start in enumerate(zero["start"]):
        want = wanted(start, zero["changed"][index], 1)
        assert torch.equal(one["after"][index], want), f"tensor {index}: copy 1 is not the {sync_dtype} mean"
        if not overlap:
            assert torch.equal(zero["after"][index], want), f"tensor {index}: copy 0 is not the {sync_dtype} mean"
        torch.testing.assert_close(zero["drained"][index], one["drained"][index], atol=0, rtol=0)
    if overlap and sync_dtype == "bf16":  # what was sent is kept as sent (bf16), no fp32 snapshot of it
        assert zero["buffers"]["kept"] == zero["buffers"]["wire"] == "torch.bfloat16"
        elements = sum(t.numel() for t in zero["start"])
        payload = elements  # shard 1 is sent whole, shard 0's 15,000 touched rows of 20,000 gathered
        payload -= 5_000 * 33
        chunks = sum(4 * CHUNK for name in zero["buffers"] if "chunk" in name or name == "scratch")
        assert zero["held"]["elements"] == elements
        assert zero["held"]["bytes"] <= 4 * elements + 2 * 2 * payload * GROWTH + chunks
    if overlap:  # copy 0 keeps its in-flight change on top of the mean, in each chunk; nothing else moved
        for shard, row in IN_FLIGHT:
            want = wanted(zero["start"][shard], zero["changed"][shard], 0)
            torch.testing.assert_close(zero["after"][shard][row], want[row] + 1.0, atol=1e-6, rtol=0)
            zero["after"][shard][row] = want[row]
        for index, start in enumerate(zero["start"]):
            want = wanted(start, zero["changed"][index], 0)
            assert torch.equal(zero["after"][index], want), f"tensor {index}: copy 0 is not the mean elsewhere"
