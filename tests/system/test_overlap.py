"""The all-to-alls of the lookup travel while the dense layers run, on real gloo process groups.

``PendingAllToAll`` against blocking ``all_to_all_single`` calls made by hand (bit-identical rows
and gradients, fp32 and bf16 on the wire); a sharded collection's gradients, rows and states after
a step bit-identical to the same step with a blocking all-to-all in its place (1x4 and 2x2, both
kernel backends, pooled and sequence, fp32 and bf16 wires); and the order autograd runs things in: a dense branch
built *before* the lookup (so a blocking all-to-all would run first in the backward) now finishes
its backward before the lookup's gradient is taken, on 1x4 and 2x2 meshes, pooled and sequence,
with both kernel backends, and the pooled forward's all-to-all is still in flight until the result
is read. A launched all-to-all is freed with its result (no reference cycle to wait for the
cycle collector: one kept every step's rows alive and slowed training down step after step); a
second backward through one lookup (``retain_graph=True``) gives its gradient again on the torch
kernels and is refused on FBGEMM's, whose first backward has updated the rows already.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.distributed.comm import PendingAllToAll
from lightning_twod.distributed.groups import group_size
from lightning_twod.sparse import output_dist
from lightning_twod.sparse.kernels import UpdateOnceError
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_collection
from tests.helpers.distributed import run_distributed
from tests.helpers.sparse_cases import make_module, random_batch


def _blocking(tensor: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = tensor.new_empty(sum(recv), *tensor.shape[1:])
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _pending_worker(rank: int, world: int, comm_dtype) -> list[str]:
    groups = MeshGroups.create(SparseParallelDims(world, 2))
    me = groups.shard_rank
    send, recv = [me + 2 * j + 1 for j in range(2)], [i + 2 * me + 1 for i in range(2)]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(send), 5, generator=gen, requires_grad=True)
    upstream = torch.randn(sum(recv), 5, generator=gen)
    order: list[str] = []
    dense = torch.nn.Linear(5, 5)
    dense.weight.register_post_accumulate_grad_hook(lambda _: order.append("dense"))
    x.register_hook(lambda g: order.append("lookup"))
    hidden = dense(torch.ones(3, 5))  # built before the all-to-all: a blocking one would run first

    pending = PendingAllToAll(x, send, recv, groups.shard, grad_scale=0.25, comm_dtype=comm_dtype)
    out = pending.wait()
    wire = x.detach() if comm_dtype is None else x.detach().to(comm_dtype)
    assert torch.equal(out, _blocking(wire, send, recv, groups.shard).to(x.dtype))
    with pytest.raises(RuntimeError, match="called already"):
        pending.wait()

    ((out * upstream).sum() + hidden.sum()).backward()
    grad_wire = upstream if comm_dtype is None else upstream.to(comm_dtype)
    assert torch.equal(x.grad, _blocking(grad_wire, recv, send, groups.shard).to(x.dtype) * 0.25)

    # no reference cycle: the launch is freed with its result, without the cycle collector
    gc.disable()
    try:
        launched = weakref.ref(pending)
        del pending, out
        assert launched() is None
    finally:
        gc.enable()
    return order


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_pending_all_to_all_is_exact_and_its_gradient_waits_for_the_dense_backward(comm_dtype):
    for order in run_distributed(_pending_worker, 4, comm_dtype):
        assert order == ["dense", "lookup"]


def _module_worker(rank: int, world: int, group_size: int, backend: str, pooled: bool, comm_dtype) -> dict:
    groups = MeshGroups.create(SparseParallelDims(world, group_size))
    reference = make_module(pooled, seed=3)
    sharded = shard_collection(reference, ShardingSpec(groups, backend=backend, comm_dtype=comm_dtype))
    order: list[str] = []

    def mark_lookup(_module, _inputs, out) -> None:  # the owned shards (the data-parallel ones send nothing)
        for rows in out if isinstance(out, list) else [out]:  # sequence kernels: rows per slot
            rows.register_hook(lambda g: order.append("lookup"))

    sharded.kernel.register_forward_hook(mark_lookup)
    bottom = torch.nn.Linear(4, 4)
    bottom.weight.register_post_accumulate_grad_hook(lambda _: order.append("dense"))
    batch = random_batch(4 * world, seed=5).split_batch([4] * world)[rank]

    hidden = bottom(torch.ones(2, 4))  # the dense branch first, as a model that runs its bottom MLP first
    expected = reference(batch)
    out = sharded(batch)
    in_flight = pooled and out._values is None  # read below: nothing waited for it yet
    if pooled:
        batch["f_rw"].lengths.fill_(1)  # edited in place before the read: the mean still uses the lengths sent
        values = out.values()
        torch.testing.assert_close(values, expected.values(), atol=1e-2 if comm_dtype else 1e-5, rtol=0)
        loss = values.pow(2).sum()
    else:
        loss = sum(j.values.pow(2).sum() for j in out.values())
    (loss + hidden.sum()).backward(retain_graph=True)
    kernel_grads = [p.grad.to_dense().clone() for p in getattr(sharded.kernel, "shard_weights", []) if p.grad is not None]
    if backend == "fbgemm":  # the first backward updated the rows: a second one before the step is refused
        with pytest.raises(UpdateOnceError):
            loss.backward()
    else:
        loss.backward()  # a second backward through the same lookup (several losses): the gradient comes again
    again = [p.grad.to_dense() for p in getattr(sharded.kernel, "shard_weights", []) if p.grad is not None]
    assert len(again) == len(kernel_grads) and all(torch.equal(b, 2 * a) for a, b in zip(kernel_grads, again))
    return {"order": order, "in_flight": in_flight, "kernel_grads": len(kernel_grads)}


@pytest.mark.parametrize("group_size", [4, 2], ids=["1x4", "2x2"])
@pytest.mark.parametrize("backend", ["torch", "fbgemm"])
def test_lookup_gradient_travels_while_the_dense_backward_runs(group_size, backend):
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    for pooled, comm_dtype in [(True, None), (False, None), (True, torch.bfloat16)]:
        reports = run_distributed(_module_worker, 4, group_size, backend, pooled, comm_dtype)
        for report in reports:
            assert report["order"][0] == "dense" and "lookup" in report["order"], (pooled, report)
            assert report["in_flight"] == pooled, (pooled, report)
        assert backend == "fbgemm" or any(r["kernel_grads"] for r in reports)  # torch kernels: compared above


class _BlockingAllToAll(torch.autograd.Function):
    """The all-to-all the overlapped one replaced: blocking in both directions, the gradient taken
    inside autograd's walk (the oracle of ``test_gradients_are_bit_identical_to_the_blocking_all_to_all``)."""

    @staticmethod
    def forward(ctx, tensor, send, recv, group, grad_scale, comm_dtype):
        ctx.args = (send, recv, group, grad_scale, comm_dtype)
        wire = tensor if comm_dtype is None else tensor.to(comm_dtype)
        out = wire.clone() if group_size(group) == 1 else _blocking(wire, send, recv, group)
        return out.to(tensor.dtype)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, grad_scale, comm_dtype = ctx.args
        wire = grad if comm_dtype is None else grad.to(comm_dtype)
        back = (wire if group_size(group) == 1 else _blocking(wire, recv, send, group)).to(grad.dtype)
        return (back * grad_scale if grad_scale != 1.0 else back), None, None, None, None, None


class _Blocking:
    """Stands in for ``PendingAllToAll``: received at once, its backward blocking."""

    made = 0

    def __init__(self, tensor, send_splits, recv_splits, group, *, grad_scale=1.0, comm_dtype=None, **_):
        _Blocking.made += 1
        self.out = _BlockingAllToAll.apply(tensor, list(send_splits), list(recv_splits), group, grad_scale,
                                           comm_dtype)

    def wait(self):
        return self.out


def _step(sharded, batch, pooled: bool) -> list[torch.Tensor]:
    """One forward and backward (and the kernels' step); this rank's shard weights, gradients and states."""
    out = sharded(batch)
    loss = out.values().pow(2).sum() if pooled else sum(j.values.pow(2).sum() for j in out.values())
    loss.backward()
    grads = [p.grad.to_dense() for k in sharded.kernels() for p in getattr(k, "shard_weights", []) if p.grad is not None]
    for kernel in sharded.kernels():
        kernel.step()
    return [*grads, *(w.clone() for _, w in sharded.local_shards()),
            *(s.clone() for k in sharded.kernels() for s in k.optimizer_states())]


def _bit_identity_worker(rank: int, world: int, group_size_: int, backend: str) -> int:
    groups = MeshGroups.create(SparseParallelDims(world, group_size_))
    compared = 0
    for pooled, comm_dtype in [(True, None), (False, None), (True, torch.bfloat16), (False, torch.bfloat16)]:
        batch = random_batch(4 * world, seed=9).split_batch([4] * world)[rank]
        runs = []
        for blocking in (True, False):
            reference = make_module(pooled, seed=3)
            sharded = shard_collection(reference, ShardingSpec(groups, backend=backend, comm_dtype=comm_dtype,
                                                               grad_scale=0.5,
                                                               optimizer=SparseOptimizerConfig("rowwise_adagrad", lr=0.1,
                                                                                               eps=1e-3)))
            saved = output_dist.PendingAllToAll, output_dist.all_to_all
            if blocking:
                output_dist.PendingAllToAll = _Blocking
                output_dist.all_to_all = lambda *args, **kwargs: _Blocking(*args, **kwargs).wait()
            made = _Blocking.made
            try:
                runs.append(_step(sharded, batch, pooled))
            finally:
                output_dist.PendingAllToAll, output_dist.all_to_all = saved
            assert (_Blocking.made > made) == blocking  # the oracle really ran the blocking all-to-all
        blocking_run, overlapped_run = runs
        assert len(blocking_run) == len(overlapped_run) > 0
        for a, b in zip(blocking_run, overlapped_run, strict=True):
            assert torch.equal(a, b), (pooled, comm_dtype, (a - b).abs().max())
        compared += len(blocking_run)
    return compared


@pytest.mark.parametrize("group_size_", [4, 2], ids=["1x4", "2x2"])
@pytest.mark.parametrize("backend", ["torch", "fbgemm"])
def test_gradients_are_bit_identical_to_the_blocking_all_to_all(group_size_, backend):
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    assert all(n > 0 for n in run_distributed(_bit_identity_worker, 4, group_size_, backend))
