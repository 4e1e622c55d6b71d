"""Lookup kernels and sparse optimizers on one process (no process group).

Oracles: FBGEMM's fused TBE equals the pure torch kernel (outputs, updated weights, optimizer
state); the functional row-wise AdaGrad equals its formula written out by hand; momentum-scaled
row-wise AdaGrad equals plain row-wise AdaGrad with ``lr * sqrt(c)``, ``eps * sqrt(c)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_twod.sparse.kernels import FbgemmKernel, ShardShape, TorchKernel, UpdateOnceError, make_kernel
from lightning_twod.sparse.optimizers import (
    OPTIMIZERS,
    SparseOptimizerConfig,
    coalesce_rows,
    sparse_update,
)

ATOL = 1e-5
# three shards; shard 0 is read by two slots (a shared table), dims 8 and 4 (two unpooled TBE ops).
# Slots are grouped by shard, in shard order, as the sharded collections build them (FBGEMM needs it).
SHAPES = [ShardShape(10, 8), ShardShape(7, 4), ShardShape(5, 8)]
SLOT_SHARDS = [0, 0, 1, 2]
BATCH = 5


def _inputs(seed: int, weighted: bool):
    """Slot-major ``(values, lengths, weights)`` with empty bags (lengths 0..3) and repeated ids."""
    gen = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for k in SLOT_SHARDS:
        lens = torch.randint(0, 4, (BATCH,), generator=gen)
        lens[seed % BATCH] = 0  # at least one empty bag per slot
        lengths.append(lens)
        values.append(torch.randint(0, SHAPES[k].rows, (int(lens.sum()),), generator=gen))
    values, lengths = torch.cat(values), torch.cat(lengths)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return values, lengths, weights


def _initial_weights(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s.rows, s.dim, generator=gen) for s in SHAPES]


def _loss(out, seed: int):
    gen = torch.Generator().manual_seed(seed)
    parts = [out] if isinstance(out, torch.Tensor) else out
    return sum((p * torch.randn(p.shape, generator=gen)).sum() for p in parts)


def _train(kernel, pooled: bool, weighted: bool, steps: int = 2):
    for k, w in enumerate(_initial_weights()):
        kernel.weights()[k].copy_(w)
    outputs = []
    for step in range(steps):
        out = kernel(*_inputs(10 + step, weighted))
        outputs.append(out.detach().clone() if pooled else [o.detach().clone() for o in out])
        _loss(out, 100 + step).backward()
        kernel.step()
    return outputs, [w.detach().clone() for w in kernel.weights()], [s.clone() for s in kernel.optimizer_states()]


CONFIGS = {
    "sgd": SparseOptimizerConfig("sgd", lr=0.1),
    "rowwise_adagrad": SparseOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-3),
    "momentum_rowwise_adagrad": SparseOptimizerConfig("momentum_rowwise_adagrad", lr=0.1, eps=1e-3,
                                                      momentum_scale=4.0),
}


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fbgemm_matches_torch_kernel(name, pooled, weighted):
    pytest.importorskip("fbgemm_gpu")
    config = CONFIGS[name]
    reference = TorchKernel(SHAPES, SLOT_SHARDS, pooled, config)
    fused = FbgemmKernel(SHAPES, SLOT_SHARDS, pooled, config)
    assert fused.fused and not reference.fused
    if not pooled:
        assert len(fused.ops) == 2  # dims 8 and 4
    t_out, t_w, t_s = _train(reference, pooled, weighted)
    f_out, f_w, f_s = _train(fused, pooled, weighted)
    for a, b in zip(t_out, f_out, strict=True):
        if pooled:
            assert a.shape == (BATCH, sum(SHAPES[k].dim for k in SLOT_SHARDS))
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        else:
            for slot, (x, y) in enumerate(zip(a, b, strict=True)):
                assert x.shape[1] == SHAPES[SLOT_SHARDS[slot]].dim
                torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    for k, (a, b) in enumerate(zip(t_w, f_w, strict=True)):
        assert a.shape == (SHAPES[k].rows, SHAPES[k].dim)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, k=k: f"shard {k}: {m}")
    # rows were really updated, and the untouched ones kept their initial values
    initial = _initial_weights()
    assert any(not torch.equal(w, w0) for w, w0 in zip(t_w, initial, strict=True))
    assert len(t_s) == len(f_s) == (0 if name == "sgd" else len(SHAPES))
    for a, b in zip(t_s, f_s, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    if name != "sgd":
        assert all((s > 0).any() for s in t_s)


def test_torch_kernel_pooled_columns_per_slot_and_empty_input():
    """Each slot's column block is the weighted sum of its shard's rows; any slot order works."""
    slot_shards = [0, 1, 0, 2]  # the torch kernel does not need slots grouped by shard
    kernel = TorchKernel(SHAPES, slot_shards, True, CONFIGS["sgd"])
    initial = _initial_weights()
    for k, w in enumerate(initial):
        kernel.weights()[k].copy_(w)
    gen = torch.Generator().manual_seed(4)
    lengths = torch.tensor([2, 0, 1, 3, 0, 1, 1, 0, 2, 2, 0, 1])  # 4 slots x 3 bags, empty bags
    values = torch.cat([torch.randint(0, SHAPES[k].rows, (int(n),), generator=gen)
                        for k, n in zip(slot_shards, lengths.view(4, 3).sum(1).tolist(), strict=True)])
    weights = torch.rand(values.numel(), generator=gen)
    out = kernel(values, lengths, weights)
    assert out.shape == (3, 8 + 4 + 8 + 8)
    col, start = 0, 0
    for slot, k in enumerate(slot_shards):
        for b in range(3):
            n = int(lengths[slot * 3 + b])
            ids, wts = values[start:start + n], weights[start:start + n]
            expected = (initial[k][ids] * wts[:, None]).sum(0)  # zeros for an empty bag
            torch.testing.assert_close(out[b, col:col + SHAPES[k].dim], expected, atol=1e-6, rtol=0)
            start += n
        col += SHAPES[k].dim
    empty = kernel(torch.zeros(0, dtype=torch.int64), torch.zeros(4 * 2, dtype=torch.int64), None)
    assert empty.shape == (2, 28) and not empty.any()


def test_fbgemm_kernel_rejects_slots_out_of_shard_order():
    """FBGEMM's CPU backward finds each table's features by scanning them in order: slots of a
    shard that are not consecutive gave wrong row-wise AdaGrad updates or a crash in backward."""
    pytest.importorskip("fbgemm_gpu")
    for slot_shards in ([0, 1, 0, 2], [1, 0, 2]):
        with pytest.raises(ValueError, match="non-decreasing") as info:
            FbgemmKernel(SHAPES, slot_shards, True, CONFIGS["rowwise_adagrad"])
        assert str(slot_shards) in str(info.value)


# ---------------------------------------------------------------- functional optimizer
def test_rowwise_adagrad_matches_hand_formula():
    lr, eps = 0.5, 0.1
    config = SparseOptimizerConfig("rowwise_adagrad", lr=lr, eps=eps)
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    state = torch.zeros(3)
    rows = torch.tensor([0, 2])
    grads = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    sparse_update(config, weight, state, rows, grads)
    # row 0: v = (1 + 9) / 2 = 5;  row 2: v = (4 + 0) / 2 = 2;  row 1 untouched
    assert state.tolist() == pytest.approx([5.0, 0.0, 2.0])
    d0, d2 = math.sqrt(5.0) + eps, math.sqrt(2.0) + eps
    expected = [[1 - lr * 1 / d0, 2 - lr * 3 / d0], [3.0, 4.0], [5 - lr * 2 / d2, 6.0]]
    torch.testing.assert_close(weight, torch.tensor(expected), atol=1e-6, rtol=0)
    # a second step accumulates: row 2 gets v = 2 + (1 + 1) / 2 = 3
    sparse_update(config, weight, state, torch.tensor([2]), torch.tensor([[1.0, -1.0]]))
    assert state.tolist() == pytest.approx([5.0, 0.0, 3.0])
    d = math.sqrt(3.0) + eps
    expected[2] = [expected[2][0] - lr / d, 6.0 + lr / d]
    torch.testing.assert_close(weight, torch.tensor(expected), atol=1e-6, rtol=0)


def test_momentum_scaled_rowwise_adagrad_formula_and_equivalence():
    c, lr, eps = 4.0, 0.2, 0.01
    scaled = SparseOptimizerConfig("momentum_rowwise_adagrad", lr=lr, eps=eps, momentum_scale=c)
    plain_lr, plain_eps = scaled.rowwise_lr_eps()
    assert (plain_lr, plain_eps) == pytest.approx((lr * 2.0, eps * 2.0))
    # other optimizers ignore momentum_scale
    assert SparseOptimizerConfig("rowwise_adagrad", lr=lr, eps=eps, momentum_scale=c).rowwise_lr_eps() == (lr, eps)
    plain = SparseOptimizerConfig("rowwise_adagrad", lr=plain_lr, eps=plain_eps)

    # one step by hand: v = mean(g^2) = 4; w -= lr * g / (sqrt(v / c) + eps)
    weight, state = torch.ones(2, 2), torch.zeros(2)
    sparse_update(scaled, weight, state, torch.tensor([1]), torch.tensor([[2.0, -2.0]]))
    step = lr / (math.sqrt(4.0 / c) + eps)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 1.0], [1 - 2 * step, 1 + 2 * step]]), atol=1e-6, rtol=0)
    assert state.tolist() == pytest.approx([0.0, 4.0])

    gen = torch.Generator().manual_seed(0)
    w_a = torch.randn(6, 3, generator=gen)
    w_b, s_a, s_b = w_a.clone(), torch.zeros(6), torch.zeros(6)
    for _ in range(4):
        rows = torch.unique(torch.randint(0, 6, (4,), generator=gen))
        grads = torch.randn(rows.numel(), 3, generator=gen)
        sparse_update(scaled, w_a, s_a, rows, grads)
        sparse_update(plain, w_b, s_b, rows, grads)
    torch.testing.assert_close(w_a, w_b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s_a, s_b, atol=0, rtol=0)
    # and it differs from unscaled AdaGrad with the same lr and eps
    w_c, s_c = w_a.clone(), s_a.clone()
    rows, grads = torch.tensor([0]), torch.ones(1, 3)
    sparse_update(scaled, w_a, s_a, rows, grads)
    sparse_update(SparseOptimizerConfig("rowwise_adagrad", lr=lr, eps=eps), w_c, s_c, rows, grads)
    assert not torch.allclose(w_a, w_c)


def test_sgd_and_empty_update():
    config = SparseOptimizerConfig("sgd", lr=0.5)
    assert not config.has_state and SparseOptimizerConfig().has_state
    weight = torch.zeros(3, 2)
    sparse_update(config, weight, None, torch.tensor([1]), torch.tensor([[2.0, -4.0]]))
    assert weight.tolist() == [[0.0, 0.0], [-1.0, 2.0], [0.0, 0.0]]
    state = torch.zeros(3)
    sparse_update(CONFIGS["rowwise_adagrad"], weight, state, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
    assert weight.tolist() == [[0.0, 0.0], [-1.0, 2.0], [0.0, 0.0]] and not state.any()


def test_coalesce_rows_sums_duplicates():
    rows = torch.tensor([3, 1, 3, 0, 1, 3])
    grads = torch.arange(12, dtype=torch.float32).view(6, 2)
    unique, summed = coalesce_rows(rows, grads)
    assert unique.tolist() == [0, 1, 3]
    assert summed.tolist() == [[6.0, 7.0], [2.0 + 8.0, 3.0 + 9.0], [0.0 + 4.0 + 10.0, 1.0 + 5.0 + 11.0]]
    # the torch kernel's step coalesces too: one row looked up twice gets the summed gradient
    kernel = TorchKernel([ShardShape(4, 2)], [0], True, SparseOptimizerConfig("sgd", lr=1.0))
    kernel(torch.tensor([2, 2]), torch.tensor([2]), None).sum().backward()
    kernel.step()
    assert kernel.weights()[0].tolist() == [[0.0, 0.0], [0.0, 0.0], [-2.0, -2.0], [0.0, 0.0]]
    assert kernel.shard_weights[0].grad is None


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"name": "lars_sgd"}, "'lars_sgd'"),
        ({"lr": 0.0}, "lr=0.0"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"eps": -1e-3}, "eps=-0.001"),
        ({"momentum_scale": 0.0}, "momentum_scale"),
    ],
)
def test_optimizer_config_validation(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SparseOptimizerConfig(**kwargs)
    assert needle in str(info.value)
    if "name" in kwargs:
        for allowed in OPTIMIZERS:
            assert allowed in str(info.value)


# ---------------------------------------------------------------- make_kernel
def test_make_kernel_backends():
    config = CONFIGS["rowwise_adagrad"]
    odd = [ShardShape(5, 6), ShardShape(3, 8), ShardShape(2, 10)]
    assert isinstance(make_kernel("torch", SHAPES, SLOT_SHARDS, True, config), TorchKernel)
    assert isinstance(make_kernel("auto", odd, [0, 1, 2], True, config), TorchKernel)
    with pytest.raises(ValueError, match="unknown kernel backend 'tbe'") as info:
        make_kernel("tbe", SHAPES, SLOT_SHARDS, True, config)
    assert "fbgemm" in str(info.value) and "torch" in str(info.value)
    with pytest.raises(ValueError, match="at least one shard"):
        make_kernel("torch", [], [], True, config)


def test_make_kernel_fbgemm_dims():
    pytest.importorskip("fbgemm_gpu")
    config = CONFIGS["rowwise_adagrad"]
    with pytest.raises(ValueError, match=r"multiples of 4.*\[6, 10\]"):
        make_kernel("fbgemm", [ShardShape(5, 6), ShardShape(3, 8), ShardShape(2, 10)], [0, 1, 2], True, config)
    assert isinstance(make_kernel("fbgemm", SHAPES, SLOT_SHARDS, False, config), FbgemmKernel)
    assert isinstance(make_kernel("auto", SHAPES, SLOT_SHARDS, True, config), FbgemmKernel)


def _two_lookups(kernel, pattern: str, weighted: bool):
    """One optimizer step split as ``pattern``: the gradient is always that of ``_loss`` on one lookup."""
    inputs = _inputs(11, weighted)
    if pattern == "one lookup":
        _loss(kernel(*inputs), 7).backward()
    elif pattern == "looked up twice":  # two lookups, one backward
        first, second = kernel(*inputs), kernel(*inputs)
        if isinstance(first, torch.Tensor):
            _loss(first / 2 + second / 2, 7).backward()
        else:
            _loss([a / 2 + b / 2 for a, b in zip(first, second, strict=True)], 7).backward()
    else:  # two backwards of half the loss, accumulating or deferred
        for _ in range(2):
            (_loss(kernel(*inputs), 7) / 2).backward()
    kernel.step()
    return [w.detach().clone() for w in kernel.weights()], [s.clone() for s in kernel.optimizer_states()]


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
@pytest.mark.parametrize("pattern", ["looked up twice", "accumulating", "deferred"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fbgemm_updates_once_per_step_from_the_summed_gradient(name, pattern, pooled):
    """However the step's gradient is split over lookups and backwards, FBGEMM applies one update from
    the sum, as the torch kernel does with one lookup and one backward."""
    pytest.importorskip("fbgemm_gpu")
    config = CONFIGS[name]
    reference, fused = TorchKernel(SHAPES, SLOT_SHARDS, pooled, config), FbgemmKernel(SHAPES, SLOT_SHARDS, pooled, config)
    for kernel in (reference, fused):
        for k, w in enumerate(_initial_weights()):
            kernel.weights()[k].copy_(w)
    fused.gate.accumulating = pattern == "accumulating"
    fused.gate.defer = pattern == "deferred"
    want_w, want_s = _two_lookups(reference, "one lookup", weighted=True)
    got_w, got_s = _two_lookups(fused, pattern, weighted=True)
    for a, b in zip([*want_w, *want_s], [*got_w, *got_s], strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    assert any(not torch.equal(w, w0) for w, w0 in zip(got_w, _initial_weights(), strict=True))


def test_fbgemm_fuses_the_only_backward_of_a_step_and_refuses_a_second_one():
    """One lookup, one backward: the TBE updates the rows inside backward (before ``step()``). A second
    backward before the step can no longer be summed with the first: it raises, naming the fixes,
    and leaves the rows as the first update left them."""
    pytest.importorskip("fbgemm_gpu")
    kernel = FbgemmKernel(SHAPES, SLOT_SHARDS, True, CONFIGS["rowwise_adagrad"])
    for k, w in enumerate(_initial_weights()):
        kernel.weights()[k].copy_(w)
    _loss(kernel(*_inputs(3, False)), 5).backward()
    after_first = [w.clone() for w in kernel.weights()]
    assert any(not torch.equal(w, w0) for w, w0 in zip(after_first, _initial_weights(), strict=True))
    out = kernel(*_inputs(4, False))
    with pytest.raises(UpdateOnceError, match="no_backward_sync.*kernel_backend='torch'"):
        _loss(out, 6).backward()
    assert all(torch.equal(w, w1) for w, w1 in zip(kernel.weights(), after_first, strict=True))
    kernel.step()  # the next step starts afresh
    _loss(kernel(*_inputs(5, False)), 7).backward()
    assert any(not torch.equal(w, w1) for w, w1 in zip(kernel.weights(), after_first, strict=True))


def _kernels(pooled: bool):
    """A torch reference and an FBGEMM kernel with the same initial rows (row-wise AdaGrad)."""
    config = CONFIGS["rowwise_adagrad"]
    kernels = TorchKernel(SHAPES, SLOT_SHARDS, pooled, config), FbgemmKernel(SHAPES, SLOT_SHARDS, pooled, config)
    for kernel in kernels:
        for k, w in enumerate(_initial_weights()):
            kernel.weights()[k].copy_(w)
    return kernels


def test_held_gradients_own_their_ids_and_an_edit_before_the_backward_is_refused():
    """The ids of a held backward are copied there: a batch edited in place between the backward and
    the step changes nothing. Edited between the lookup and its backward, it is refused (as autograd
    refuses a saved tensor modified in place) instead of updating other rows."""
    pytest.importorskip("fbgemm_gpu")
    reference, fused = _kernels(pooled=True)
    fused.gate.accumulating = True
    want = _two_lookups(reference, "one lookup", weighted=False)[0]
    values, lengths, weights = _inputs(11, False)
    for _ in range(2):
        (_loss(fused(values, lengths, weights), 7) / 2).backward()
    values.fill_(0)
    fused.step()
    for a, b in zip(want, fused.weights(), strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    out = fused(values, lengths, weights)
    values.fill_(1)
    with pytest.raises(RuntimeError, match="modified in place between the lookup and its backward"):
        _loss(out, 7).backward()


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "held"])
def test_gradient_marks_name_the_shard_with_a_non_finite_gradient_until_the_step_is_reset(pooled, fuse):
    """A NaN in the gradient of slot 2 (shard 1) marks shard 1 only, fused (with ``check_gradients``) or
    held; ``reset_step`` forgets it, and the next step is an ordinary one (no ``UpdateOnceError``)."""
    pytest.importorskip("fbgemm_gpu")
    _, kernel = _kernels(pooled)
    kernel.gate.check_gradients = True
    kernel.gate.accumulating = not fuse
    out = kernel(*_inputs(11, False))
    if pooled:
        out.register_hook(lambda g: g.index_fill(1, torch.arange(16, 20), float("nan")))  # slot 2: shard 1's columns
        _loss(out, 7).backward()
    else:
        out[2].register_hook(lambda g: g * float("nan"))
        _loss(out, 7).backward()
    marks = kernel.gradient_marks()
    assert torch.isnan(marks[1]) and torch.equal(marks[[0, 2]], torch.zeros(2))
    kernel.reset_step()
    assert torch.equal(kernel.gradient_marks(), torch.zeros(3)) and not kernel.pending_rows()
    kernel.gate.accumulating = False
    before = [w.clone() for w in kernel.weights()]
    _loss(kernel(*_inputs(12, False)), 8).backward()  # fused again: the rows change inside backward
    assert any(not torch.equal(w, w0) for w, w0 in zip(kernel.weights(), before, strict=True) if not w0.isnan().any())


@pytest.mark.parametrize("backend", ["torch", "fbgemm"])
def test_rows_waiting_for_the_step_are_marked_again_after_a_reduction_took_the_marks(backend):
    """A drain in the middle of an accumulation takes the touched-row marks; the rows whose gradients
    still wait for the step are shown to the observers again, or the next round would miss them."""
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    from lightning_twod.replication.touched import TouchedRows

    reference, fused = _kernels(pooled=True)
    kernel = reference if backend == "torch" else fused
    if backend == "fbgemm":
        kernel.gate.accumulating = True
    touched = TouchedRows(kernel)
    values, lengths, weights = _inputs(11, False)
    _loss(kernel(values, lengths, weights), 7).backward()
    looked_up = touched.take()
    assert looked_up.any() and not touched.mask.any()
    kernel.mark_pending()
    assert torch.equal(touched.mask, looked_up)
