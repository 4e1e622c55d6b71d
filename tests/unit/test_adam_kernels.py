"""The Adam family of sparse optimizers on one process (no process group).

Oracles: over several steps with repeated and missing rows, the torch kernel's rows and state equal
an optimizer from ``torch.optim`` (``Adam``, ``AdamW``) run on the unsharded tables with one
parameter per row and the untouched rows' gradients left ``None`` (so that a row is updated, and its
step counted, only when touched); ``rowwise_adam`` and ``lamb``, which ``torch.optim`` lacks, equal
``torch.optim.Optimizer`` subclasses written out from FBGEMM's partial row-wise Adam and from the LAMB
paper (You et al., arXiv 1904.00962, Algorithm 2), each row a layer. FBGEMM's fused ``ADAM`` equals the
torch kernel where CUDA is present.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_twod.sparse.kernels import (
    FbgemmKernel,
    TorchKernel,
    fbgemm_refusal,
    make_kernel,
    resolve_backend,
)
from lightning_twod.sparse.optimizers import ADAM_OPTIMIZERS, SparseOptimizerConfig, sparse_update
from tests.unit.test_kernels import BATCH, SHAPES, SLOT_SHARDS, _initial_weights, _inputs, _loss

STEPS = 5
LR, EPS, BETAS = 0.05, 1e-6, (0.8, 0.95)  # betas away from the defaults, so that a swapped pair shows


class _RowwiseAdam(torch.optim.Optimizer):
    """TorchRec's partial row-wise Adam on each parameter (a row) as FBGEMM writes it: element-wise
    first moment, one second moment of ``mean(g**2)``; L2 weight decay as ``torch.optim.Adam``."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=0.0)
                grad = p.grad + group["weight_decay"] * p
                state["step"] += 1
                t = state["step"]
                state["m"] = beta1 * state["m"] + (1 - beta1) * grad
                state["v"] = beta2 * state["v"] + (1 - beta2) * float((grad ** 2).mean())
                v_hat = state["v"] / (1 - beta2 ** t)
                p -= lr * (state["m"] / (1 - beta1 ** t)) / (math.sqrt(v_hat) + eps)


class _PaperLamb(torch.optim.Optimizer):
    """LAMB as the paper's Algorithm 2 (with bias correction, decoupled weight decay inside the trust
    ratio, ``phi`` the identity), each parameter (a row) its own layer; ratio 1 where a norm is 0."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                t, grad = state["step"], p.grad
                state["m"] = beta1 * state["m"] + (1 - beta1) * grad
                state["v"] = beta2 * state["v"] + (1 - beta2) * grad * grad
                r = (state["m"] / (1 - beta1 ** t)) / ((state["v"] / (1 - beta2 ** t)).sqrt() + eps)
                r = r + group["weight_decay"] * p
                w_norm, r_norm = float(p.norm()), float(r.norm())
                ratio = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
                p -= lr * ratio * r


REFERENCES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rowwise_adam": _RowwiseAdam, "lamb": _PaperLamb}


def _config(name: str, weight_decay: float) -> SparseOptimizerConfig:
    return SparseOptimizerConfig(name, lr=LR, eps=EPS, beta1=BETAS[0], beta2=BETAS[1], weight_decay=weight_decay)


def _reference_lookup(tables, values, lengths, weights, pooled: bool):
    """The kernel's lookup written with plain indexing on the unsharded ``tables`` ([rows_k, dim_k])."""
    per_slot = lengths.view(len(SLOT_SHARDS), -1)
    counts = per_slot.sum(dim=1).tolist()
    weights = weights if weights is not None else torch.ones(values.numel())
    outs = []
    for k, ids, lens, wts in zip(SLOT_SHARDS, values.split(counts), per_slot, weights.split(counts), strict=True):
        rows = tables[k][ids] * wts.unsqueeze(1)
        bags = torch.repeat_interleave(torch.arange(BATCH), lens)
        outs.append(torch.zeros(BATCH, tables[k].shape[1]).index_add(0, bags, rows) if pooled else rows)
    return torch.cat(outs, dim=1) if pooled else outs


def _train_reference(name: str, weight_decay: float, pooled: bool):
    """One ``torch.optim`` parameter per row; a row not looked up in a step keeps ``grad=None``."""
    rows = [[torch.nn.Parameter(row.clone()) for row in table] for table in _initial_weights()]
    optimizer = REFERENCES[name]([p for table in rows for p in table], lr=LR, betas=BETAS, eps=EPS,
                                 weight_decay=weight_decay)
    for step in range(STEPS):
        values, lengths, weights = _inputs(10 + step, weighted=True)
        out = _reference_lookup([torch.stack(table) for table in rows], values, lengths, weights, pooled)
        optimizer.zero_grad(set_to_none=True)
        _loss(out, 100 + step).backward()
        touched = [set() for _ in SHAPES]
        for k, ids in zip(SLOT_SHARDS, values.split(lengths.view(len(SLOT_SHARDS), -1).sum(dim=1).tolist())):
            touched[k].update(ids.tolist())
        for k, table in enumerate(rows):
            for r, p in enumerate(table):
                if r not in touched[k]:
                    p.grad = None
        optimizer.step()
    return [torch.stack([p.detach() for p in table]) for table in rows], optimizer, rows


def _train_kernel(kernel, pooled: bool):
    for k, w in enumerate(_initial_weights()):
        kernel.weights()[k].copy_(w)
    for step in range(STEPS):
        out = kernel(*_inputs(10 + step, weighted=True))
        _loss(out, 100 + step).backward()
        kernel.step()
    return [w.detach().clone() for w in kernel.weights()], [{n: s.clone() for n, s in states.items()}
                                                            for states in kernel.shard_states()]


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no_decay", "decay"])
@pytest.mark.parametrize("name", ADAM_OPTIMIZERS)
def test_torch_kernel_equals_torch_optim_on_each_touched_row(name, weight_decay, pooled):
    kernel = TorchKernel(SHAPES, SLOT_SHARDS, pooled, _config(name, weight_decay))
    got_w, got_s = _train_kernel(kernel, pooled)
    want_w, optimizer, params = _train_reference(name, weight_decay, pooled)
    for k, (a, b) in enumerate(zip(got_w, want_w, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=lambda m, k=k: f"shard {k}: {m}")
    counts = torch.cat([s["step"] for s in got_s])
    assert counts.max() == STEPS and len(set(counts.tolist())) > 2  # rows missing on different steps
    for k, table in enumerate(params):
        for r, p in enumerate(table):
            state = optimizer.state[p]
            assert got_s[k]["step"][r] == float(state.get("step", 0))
            if not state:
                continue
            m = state.get("exp_avg", state.get("m"))
            torch.testing.assert_close(got_s[k]["momentum1"][r], m, atol=1e-6, rtol=1e-5)
            v = state.get("exp_avg_sq", state.get("v"))
            torch.testing.assert_close(got_s[k]["momentum2"][r], torch.as_tensor(v, dtype=torch.float32),
                                       atol=1e-7, rtol=1e-5)


def test_bias_correction_counts_the_steps_that_touched_the_row():
    """Row 0 is touched on steps 1-3, row 1 first on step 3: row 1's update is Adam's first step
    (``m_hat = g``, ``v_hat = g**2``: ``lr * sign(g)``), not the one the global step 3 would give."""
    config = _config("adam", 0.0)
    weight = torch.zeros(3, 2)
    state = {name: torch.zeros(shape) for name, shape in config.state_shapes(3, 2).items()}
    for _ in range(2):
        sparse_update(config, weight, state, torch.tensor([0]), torch.tensor([[1.0, -2.0]]))
    sparse_update(config, weight, state, torch.tensor([0, 1]), torch.tensor([[1.0, -2.0], [0.5, -4.0]]))
    assert state["step"].tolist() == [3.0, 1.0, 0.0]
    torch.testing.assert_close(weight[1], torch.tensor([-LR, LR]), atol=1e-5, rtol=0)
    torch.testing.assert_close(weight[0], torch.tensor([-3 * LR, 3 * LR]), atol=1e-5, rtol=0)  # g constant
    beta1, beta2 = BETAS
    global_step = (1 - beta1) * 0.5 / (1 - beta1 ** 3) / (math.sqrt((1 - beta2) * 0.25 / (1 - beta2 ** 3)) + EPS)
    assert global_step < 0.7 and abs(weight[1, 0] + LR * global_step) > 0.3 * LR  # step 3's correction: 0.69 lr
    assert not weight[2].any() and not state["momentum1"][2].any()


@pytest.mark.parametrize("name, expected", [("adam", 2.0 - LR), ("adamw", 2.0 * (1 - LR * 0.1)), ("lamb", 2.0 * (1 - LR))])
def test_weight_decay_form_follows_the_name(name, expected):
    """A touched row whose gradient is 0: L2 (``adam``) turns ``0.1 * w`` into Adam's normalised step of
    size ``lr``; decoupled (``adamw``) shrinks the row by ``lr * 0.1``; LAMB's trust ratio makes its step
    ``lr * |w|`` (the update is ``0.1 * w`` alone)."""
    config = _config(name, 0.1)
    weight = torch.tensor([[2.0, 2.0]])
    state = {n: torch.zeros(shape) for n, shape in config.state_shapes(1, 2).items()}
    sparse_update(config, weight, state, torch.tensor([0]), torch.zeros(1, 2))
    torch.testing.assert_close(weight, torch.full((1, 2), expected), atol=1e-5, rtol=0)


def test_state_shapes_and_one_buffer_per_state():
    """Each state's first dim is rows; a torch kernel lays each state's shards end to end in one
    buffer, as it does the weights; the row-wise optimizers keep their one accumulator."""
    shapes = {name: SparseOptimizerConfig(name).state_shapes(10, 8) for name in ADAM_OPTIMIZERS}
    assert shapes["adam"] == shapes["adamw"] == shapes["lamb"] == {
        "momentum1": (10, 8), "momentum2": (10, 8), "step": (10,)}
    assert shapes["rowwise_adam"] == {"momentum1": (10, 8), "momentum2": (10,), "step": (10,)}
    assert SparseOptimizerConfig("rowwise_adagrad").state_shapes(10, 8) == {"momentum1": (10,)}
    assert SparseOptimizerConfig("sgd").state_shapes(10, 8) == {}

    kernel = TorchKernel(SHAPES, SLOT_SHARDS, True, _config("rowwise_adam", 0.0))
    states = kernel.shard_states()
    for name in ("momentum1", "momentum2", "step"):
        storages = {s[name].untyped_storage().data_ptr() for s in states}
        assert len(storages) == 1, name
        assert [s[name].shape[0] for s in states] == [shape.rows for shape in SHAPES]
    with pytest.raises(ValueError, match=r"'rowwise_adam' keeps \['momentum1', 'momentum2', 'step'\].*shard_states"):
        kernel.optimizer_states()
    adagrad = TorchKernel(SHAPES, SLOT_SHARDS, True, SparseOptimizerConfig("rowwise_adagrad"))
    assert [s.shape for s in adagrad.optimizer_states()] == [(shape.rows,) for shape in SHAPES]
    assert TorchKernel(SHAPES, SLOT_SHARDS, True, SparseOptimizerConfig("sgd")).optimizer_states() == []


def test_adam_state_must_come_by_name():
    config = _config("adam", 0.0)
    with pytest.raises(ValueError, match=r"'adam' keeps \['momentum1', 'momentum2', 'step'\].*by name"):
        sparse_update(config, torch.zeros(3, 2), torch.zeros(3), torch.tensor([0]), torch.ones(1, 2))


@pytest.mark.parametrize("kwargs, needle", [
    ({"name": "rowwise_adagrad", "weight_decay": 0.1}, "'rowwise_adagrad' has no weight decay"),
    ({"name": "adam", "weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"name": "adam", "beta1": 1.0}, "beta1=1.0"),
    ({"name": "lamb", "beta2": -0.5}, "beta2=-0.5"),
])
def test_adam_config_validation(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SparseOptimizerConfig(**kwargs)
    assert needle in str(info.value)


# ---------------------------------------------------------------- backend choice and FBGEMM
def test_auto_backend_takes_torch_where_fbgemm_cannot_fuse_the_optimizer():
    """FBGEMM's Adam kernels are CUDA only and correct bias with each row's step only for ``ADAM``;
    its weight decay is decoupled. ``auto`` takes torch then, with the reason; ``fbgemm`` refuses."""
    dims = [8, 4]

    def resolve(backend, name, device="cpu", weight_decay=0.0):
        return resolve_backend(backend, dims, True, [_config(name, weight_decay)], device)

    for name in ADAM_OPTIMIZERS:
        backend, why = resolve("auto", name)
        assert backend == "torch" and name in why
    assert "CPU" in resolve("auto", "adamw")[1]
    assert "each row's own" in resolve("auto", "rowwise_adam", "cuda")[1]
    assert "each row's own" in resolve("auto", "lamb", "cuda")[1]
    assert "'adamw'" in resolve("auto", "adam", "cuda", 0.1)[1]
    assert resolve("auto", "adamw", "cuda", 0.1) == resolve("auto", "adam", "cuda") == resolve("auto", "rowwise_adagrad")
    assert resolve("auto", "adam", "cuda")[0] == "fbgemm"
    with pytest.raises(ValueError, match=r"backend='fbgemm' but .*'lamb'.*use backend='torch'"):
        resolve("fbgemm", "lamb", "cuda")
    assert resolve("torch", "lamb") == ("torch", "asked for")
    assert fbgemm_refusal(SparseOptimizerConfig("momentum_rowwise_adagrad")) is None
    assert resolve_backend("auto", dims, True) == resolve("auto", "sgd")  # no optimizer named: as before


def test_make_kernel_on_cpu_takes_torch_for_adam():
    pytest.importorskip("fbgemm_gpu")
    config = _config("adam", 0.0)
    assert isinstance(make_kernel("auto", SHAPES, SLOT_SHARDS, True, config), TorchKernel)
    with pytest.raises(ValueError, match="no CPU kernel for ADAM.*backend='torch'"):
        make_kernel("fbgemm", SHAPES, SLOT_SHARDS, True, config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FBGEMM's ADAM kernel runs on CUDA only")
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
@pytest.mark.parametrize("name, weight_decay", [("adam", 0.0), ("adamw", 0.1)])
def test_fbgemm_adam_equals_torch_kernel(name, weight_decay, pooled):
    pytest.importorskip("fbgemm_gpu")
    config, cuda = _config(name, weight_decay), torch.device("cuda")
    fused = FbgemmKernel(SHAPES, SLOT_SHARDS, pooled, config, cuda)
    reference = TorchKernel(SHAPES, SLOT_SHARDS, pooled, config, cuda)
    for kernel in (fused, reference):
        for k, w in enumerate(_initial_weights()):
            kernel.weights()[k].copy_(w)
        for step in range(STEPS):
            inputs = [t.to(cuda) if t is not None else None for t in _inputs(10 + step, weighted=True)]
            out = kernel(*inputs)
            _loss([o.cpu() for o in out] if isinstance(out, list) else out.cpu(), 100 + step).backward()
            kernel.step()
    for a, b in zip(fused.weights(), reference.weights(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(fused.shard_states(), reference.shard_states(), strict=True):
        assert list(a) == list(b) == ["momentum1", "momentum2", "step"]
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=1e-5, rtol=1e-5)
