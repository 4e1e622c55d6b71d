"""The differentiable all-to-all on 4 gloo processes, over the whole world and over the shard groups
of a 2x2 mesh, with uneven (and zero) splits: received values, gradients (reverse all-to-all times
``grad_scale``), the bfloat16 wire and the bytes counted per peer are all checked exactly.
"""

from __future__ import annotations

import torch

from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.distributed.comm import ByteCounter, all_to_all, exchange
from tests.helpers.distributed import run_distributed

# ---------------------------------------------------------------- (b) all-to-all on 4 ranks
COLS = 3


def _world_split(src: int, dst: int) -> int:
    """Rows global rank ``src`` sends to ``dst``: uneven, zero for some pairs (0..3)."""
    return (src + 2 * dst) % 4


def _block(src: int, dst: int, n: int) -> torch.Tensor:
    """Rows ``src`` sends to ``dst``: every value says where it came from (exact in fp32)."""
    rows = torch.arange(n, dtype=torch.float32)[:, None]
    return 1000.0 * src + 100.0 * dst + rows + 0.25 * torch.arange(COLS)


def _upstream(dst: int, n: int) -> torch.Tensor:
    """A known gradient of the output of rank ``dst``."""
    return 10000.0 * (dst + 1) + torch.arange(n * COLS, dtype=torch.float32).view(n, COLS) * 0.5


def _check_world(rank: int, world: int) -> None:
    send = [_world_split(rank, p) for p in range(world)]
    recv = [_world_split(q, rank) for q in range(world)]
    x = torch.cat([_block(rank, p, send[p]) for p in range(world)]).requires_grad_()
    counter = ByteCounter(rank, world)
    out = all_to_all(x, send, recv, None if world == 1 else torch.distributed.group.WORLD,
                     grad_scale=0.5, counter=counter, name="x", peers=list(range(world)))
    expected = torch.cat([_block(q, rank, recv[q]) for q in range(world)])
    assert torch.equal(out, expected), (out, expected)
    out.backward(_upstream(rank, sum(recv)))
    # rank p's upstream gradient rows that came from this rank, halved
    expected_grad = []
    for p in range(world):
        start = sum(_world_split(q, p) for q in range(rank))
        expected_grad.append(_upstream(p, sum(_world_split(q, p) for q in range(world)))[start:start + send[p]])
    assert torch.equal(x.grad, 0.5 * torch.cat(expected_grad))
    elem = 4 * COLS
    assert counter.sent["x"] == [0 if p == rank else send[p] * elem for p in range(world)]
    assert counter.sent["x_grad"] == [0 if p == rank else recv[p] * elem for p in range(world)]

    # bfloat16 on the wire: float32 out, bf16 accuracy, exactly half the bytes both ways
    x_bf = x.detach().clone().requires_grad_()
    counter_bf = ByteCounter(rank, world)
    out_bf = all_to_all(x_bf, send, recv, torch.distributed.group.WORLD, grad_scale=0.5,
                        comm_dtype=torch.bfloat16, counter=counter_bf, name="x", peers=list(range(world)))
    assert out_bf.dtype == torch.float32
    torch.testing.assert_close(out_bf, expected, rtol=2 ** -8, atol=0)
    assert not torch.equal(out_bf, expected) or sum(recv) == 0  # it really went through bf16
    out_bf.backward(_upstream(rank, sum(recv)))
    torch.testing.assert_close(x_bf.grad, x.grad, rtol=2 ** -8, atol=0)
    for name in ("x", "x_grad"):
        assert counter_bf.sent[name] == [b // 2 for b in counter.sent[name]]
    assert 2 * counter_bf.total() == counter.total() > 0


def _check_subgroup(rank: int, world: int) -> None:
    groups = MeshGroups.create(SparseParallelDims(world, 2))
    peers = groups.shard_ranks
    me = groups.shard_rank
    assert peers[me] == rank and len(peers) == 2

    def split(i: int, j: int) -> int:  # group position i sends to position j
        return i + 2 * j + 1

    send = [split(me, j) for j in range(2)]
    recv = [split(i, me) for i in range(2)]
    x = torch.cat([torch.full((send[j],), 10.0 * rank + peers[j]) + torch.arange(send[j]) / 8 for j in range(2)])
    x.requires_grad_()
    counter = ByteCounter(rank, world)
    out = all_to_all(x, send, recv, groups.shard, grad_scale=3.0, counter=counter, name="sub", peers=peers)
    expected = torch.cat([torch.full((recv[i],), 10.0 * peers[i] + rank) + torch.arange(recv[i]) / 8
                          for i in range(2)])
    assert torch.equal(out, expected)
    grad_out = torch.arange(sum(recv), dtype=torch.float32) + 100.0 * rank
    out.backward(grad_out)
    # position j received our block at offset sum of split(i, j) for i < me; gradient comes back x3
    expected_grad = []
    for j in range(2):
        start = sum(split(i, j) for i in range(me))
        peer_grad = torch.arange(sum(split(i, j) for i in range(2)), dtype=torch.float32) + 100.0 * peers[j]
        expected_grad.append(3.0 * peer_grad[start:start + send[j]])
    assert torch.equal(x.grad, torch.cat(expected_grad))
    other = peers[1 - me]
    outside = [p for p in range(world) if p not in peers]
    assert counter.sent["sub"][other] == send[1 - me] * 4 and counter.sent["sub"][rank] == 0
    assert counter.sent["sub_grad"][other] == recv[1 - me] * 4
    assert counter.total(peers=outside) == 0

    # the non-differentiable exchange of int64 ids over the subgroup
    ids = torch.cat([torch.full((send[j],), 100 * rank + peers[j], dtype=torch.int64) for j in range(2)])
    got = exchange(ids, send, recv, groups.shard, counter, "ids", peers)
    assert got.dtype == torch.int64
    assert got.tolist() == [100 * peers[i] + rank for i in range(2) for _ in range(recv[i])]
    assert counter.sent["ids"][other] == send[1 - me] * 8


def _all_to_all_worker(rank, world):
    _check_world(rank, world)
    _check_subgroup(rank, world)
    return rank


def test_all_to_all_world_and_subgroup_4_ranks():
    assert run_distributed(_all_to_all_worker, 4, timeout=120) == [0, 1, 2, 3]
