"""fp16 tables (``EmbeddingTableConfig(dtype="fp16")``) on one process (no process group).

Oracles: the torch kernel with fp16 rows equals an fp32 torch kernel whose rows are rounded to fp16 by
hand after every update (outputs, rows and fp32 state bit for bit: the inputs' weights and the loss's
coefficients are dyadic, so every gradient sum is exact in any order); SGD on fp16 rows equals its
formula written out here; FBGEMM's fused fp16 TBE (stochastic rounding) equals the torch kernel within
fp16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from lightning_twod import EmbeddingBagCollection, EmbeddingCollection, EmbeddingTableConfig, SparseFeatures
from lightning_twod.core.shards import place_tables
from lightning_twod.distributed.groups import MeshGroups
from lightning_twod.planner.evaluate import evaluate
from lightning_twod.planner.inputs import ROW_BYTES, TableSpec, Workload
from lightning_twod.planner.traffic import predict_traffic
from lightning_twod.replication.verify import digest
from lightning_twod.sparse.kernels import FbgemmKernel, TorchKernel, make_kernel
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardingSpec, tables_by_part
from lightning_twod.sparse.wrap import embedding_tables, shard_collection, shard_model
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator
from tests.unit.test_kernels import BATCH, SHAPES, SLOT_SHARDS

STEPS = 4
HALF = torch.float16
CONFIGS = {
    "sgd": SparseOptimizerConfig("sgd", lr=0.1),
    "rowwise_adagrad": SparseOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-3),
    "momentum_rowwise_adagrad": SparseOptimizerConfig("momentum_rowwise_adagrad", lr=0.1, eps=1e-3,
                                                      momentum_scale=4.0),
    "rowwise_adam": SparseOptimizerConfig("rowwise_adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95,
                                          weight_decay=0.01),
    "adam": SparseOptimizerConfig("adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95),
    "adamw": SparseOptimizerConfig("adamw", lr=0.05, eps=1e-6, weight_decay=0.1),
    "lamb": SparseOptimizerConfig("lamb", lr=0.05, eps=1e-6, weight_decay=0.1),
}


def _inputs(seed: int, weighted: bool):
    """Slot-major ``(values, lengths, weights)``, repeated ids and empty bags; weights in {0.5, 1, 1.5, 2}."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(SLOT_SHARDS), BATCH), generator=gen)
    lengths[:, seed % BATCH] = 0
    values = torch.cat([torch.randint(0, SHAPES[k].rows, (int(lens.sum()),), generator=gen)
                        for k, lens in zip(SLOT_SHARDS, lengths, strict=True)])
    weights = torch.randint(1, 5, (values.numel(),), generator=gen) / 2 if weighted else None
    return values, lengths.flatten(), weights


def _loss(out, seed: int) -> torch.Tensor:
    """``sum(out * c)`` with ``c`` in multiples of 1/8: each id's gradient is exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    parts = [out] if isinstance(out, torch.Tensor) else out
    return sum((p * (torch.randint(-8, 9, p.shape, generator=gen) / 8)).sum() for p in parts)


def _initial_weights() -> list[torch.Tensor]:
    """fp32 rows that fp16 holds exactly."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s.rows, s.dim, generator=gen).half().float() for s in SHAPES]


def _train(kernel, pooled: bool, weighted: bool, round_by_hand: bool = False):
    """``STEPS`` steps; per step the outputs, then the rows (fp32) and the states after the step."""
    for weight, start in zip(kernel.weights(), _initial_weights(), strict=True):
        weight.copy_(start)
    trace = []
    for step in range(STEPS):
        out = kernel(*_inputs(10 + step, weighted))
        outs = [out] if pooled else out
        _loss(out, 100 + step).backward()
        kernel.step()
        if round_by_hand:
            for weight in kernel.weights():
                weight.copy_(weight.half())
        states = [s.clone() for shard in kernel.shard_states() for s in shard.values()]
        trace.append(([o.detach().clone() for o in outs], [w.float().clone() for w in kernel.weights()], states))
    return trace


def _assert_traces_equal(got, expected) -> None:
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        for what, x, y in zip(("outputs", "rows", "states"), a, b, strict=True):
            assert len(x) == len(y)
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                assert u.dtype == v.dtype == torch.float32, (what, u.dtype, v.dtype)
                assert torch.equal(u, v), f"step {step} {what}[{i}]: max diff {(u - v).abs().max()}"


# ----------------------------------------------------------------------------- the config
def test_dtype_defaults_to_fp32_and_anything_else_is_refused_naming_the_table():
    assert EmbeddingTableConfig("t", 4, 2).dtype == "fp32"
    assert EmbeddingTableConfig("t", 4, 2, dtype="fp16").torch_dtype == HALF
    with pytest.raises(ValueError, match=r"table 't_big': dtype='bf16'; use one of \('fp32', 'fp16'\)"):
        EmbeddingTableConfig("t_big", 4, 2, dtype="bf16")


@pytest.mark.parametrize("kind", [EmbeddingBagCollection, EmbeddingCollection])
def test_an_unsharded_fp16_table_keeps_its_fp32_twins_rows_rounded_and_returns_fp32(kind):
    pooling = "sum" if kind is EmbeddingBagCollection else "none"
    tables = [EmbeddingTableConfig("t", 50, 8, ["f"], pooling=pooling, dtype=dtype) for dtype in ("fp32", "fp16")]
    torch.manual_seed(0)
    full = kind(tables[:1])
    torch.manual_seed(0)
    half = kind(tables[1:])
    (key, weight), = half.state_dict().items()
    assert weight.dtype == HALF
    assert torch.equal(weight, full.state_dict()[key].half())
    features = SparseFeatures.from_dict({"f": [[1, 2, 2], [], [49]]})
    full.load_state_dict({key: weight.float()})
    if kind is EmbeddingBagCollection:
        got, expected = half(features).values(), full(features).values()
    else:
        got, expected = half(features)["f"].values, full(features)["f"].values
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


# ----------------------------------------------------------------------------- the torch kernel
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp16_rows_equal_fp32_rows_rounded_to_fp16_after_every_update(name, pooled, weighted):
    half = TorchKernel(SHAPES, SLOT_SHARDS, pooled, CONFIGS[name], dtype=HALF)
    assert all(w.dtype == HALF for w in half.weights())
    assert all(s.dtype == torch.float32 for shard in half.shard_states() for s in shard.values())
    got = _train(half, pooled, weighted)
    expected = _train(TorchKernel(SHAPES, SLOT_SHARDS, pooled, CONFIGS[name]), pooled, weighted, round_by_hand=True)
    _assert_traces_equal(got, expected)
    unrounded = _train(TorchKernel(SHAPES, SLOT_SHARDS, pooled, CONFIGS[name]), pooled, weighted)
    assert not torch.equal(torch.cat([w.flatten() for w in got[-1][1]]),
                           torch.cat([w.flatten() for w in unrounded[-1][1]])), "fp16 rounding must show"


def test_sgd_on_fp16_rows_is_the_fp32_update_rounded_to_nearest_written_out():
    config = CONFIGS["sgd"]
    kernel = TorchKernel(SHAPES, SLOT_SHARDS, True, config, dtype=HALF)
    start = _initial_weights()
    expected = [w.clone() for w in start]  # fp32 copies of the fp16 rows
    for weight, w in zip(kernel.weights(), start, strict=True):
        weight.copy_(w)
    values, lengths, weights = _inputs(3, weighted=True)
    out = kernel(values, lengths, weights)
    out.retain_grad()
    _loss(out, 4).backward()
    kernel.step()
    # each id's gradient: its bag's output gradient (the slot's columns) times the id's weight
    columns = torch.cumsum(torch.tensor([0] + [SHAPES[k].dim for k in SLOT_SHARDS]), 0)
    bags = torch.repeat_interleave(torch.arange(len(SLOT_SHARDS) * BATCH), lengths)
    grads = [torch.zeros_like(w) for w in start]
    for i, (row, weight) in enumerate(zip(values.tolist(), weights.tolist(), strict=True)):
        slot, bag = divmod(int(bags[i]), BATCH)
        k = SLOT_SHARDS[slot]
        grads[k][row] += weight * out.grad[bag, columns[slot]:columns[slot + 1]]
    for k, (w, g) in enumerate(zip(expected, grads, strict=True)):
        touched = g.abs().sum(dim=1) > 0
        assert touched.any()
        w[touched] = (w[touched] - config.lr * g[touched]).half().float()
        assert torch.equal(kernel.weights()[k].float(), w), k


def test_the_fp16_kernel_holds_fp32_gradients_and_marks_a_nonfinite_one():
    kernel = TorchKernel(SHAPES, SLOT_SHARDS, True, CONFIGS["rowwise_adagrad"], dtype=HALF)
    for weight, start in zip(kernel.weights(), _initial_weights(), strict=True):
        weight.copy_(start)
    values, lengths, weights = _inputs(5, weighted=False)
    out = kernel(values, lengths, weights)
    (out * 1e6).sum().backward()  # 1e6 * the row: past fp16's range (65504), an fp32 gradient holds it
    grads = kernel.sparse_gradients()
    assert all(g is None or g[1].dtype == torch.float32 for g in grads)
    assert max(g[1].abs().max() for g in grads if g is not None) > 65504
    assert set(kernel.pending_rows()) == {k for k, g in enumerate(grads) if g is not None}
    assert torch.equal(kernel.gradient_marks(), torch.zeros(len(SHAPES)))
    kernel.reset_step()
    assert kernel.pending_rows() == {}
    out = kernel(values, lengths, weights)
    (out * float("inf")).sum().backward()
    assert torch.isnan(kernel.gradient_marks()).any()


# ----------------------------------------------------------------------------- FBGEMM
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "momentum_rowwise_adagrad"])
def test_fbgemm_fp16_equals_the_torch_kernel_within_fp16_rounding(name, pooled):
    pytest.importorskip("fbgemm_gpu")
    fbgemm = make_kernel("fbgemm", SHAPES, SLOT_SHARDS, pooled, CONFIGS[name], dtype=HALF)
    assert isinstance(fbgemm, FbgemmKernel)
    assert all(w.dtype == HALF for w in fbgemm.weights())
    assert all(s.dtype == torch.float32 for shard in fbgemm.shard_states() for s in shard.values())
    got = _train(fbgemm, pooled, weighted=False)
    expected = _train(TorchKernel(SHAPES, SLOT_SHARDS, pooled, CONFIGS[name], dtype=HALF), pooled, weighted=False)
    # The loss is linear: the gradients, and the states, do not depend on the rows, so the rows differ only by
    # their roundings, nearest (torch: half an ulp) or stochastic (FBGEMM: under one): after t updates, by
    # less than 1.5 t ulps of the largest value the row took.
    largest = [w.abs() for w in _initial_weights()]
    moved = False
    for step, ((outs, rows, states), (outs_t, rows_t, states_t)) in enumerate(zip(got, expected, strict=True)):
        for x, y in zip(outs, outs_t, strict=True):  # sums of up to 3 rows, each off by its roundings
            torch.testing.assert_close(x, y, atol=3 * 1.5 * (step + 1) * torch.finfo(HALF).eps * 4, rtol=0)
        for k, (w, w_t, start) in enumerate(zip(rows, rows_t, _initial_weights(), strict=True)):
            largest[k] = torch.maximum(largest[k], w_t.abs())
            ulps = (w - w_t).abs() / (torch.finfo(HALF).eps * largest[k]).clamp(min=2.0 ** -24)
            assert (ulps <= 1.5 * (step + 1)).all(), (step, k, ulps.max())
            moved |= bool((w_t != start).any())
        for s, s_t in zip(states, states_t, strict=True):
            assert torch.equal(s, s_t)
    assert moved


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
def test_fbgemm_fp16_updates_held_for_the_step_round_to_nearest_as_the_torch_kernel(name):
    pytest.importorskip("fbgemm_gpu")
    fbgemm = make_kernel("fbgemm", SHAPES, SLOT_SHARDS, True, CONFIGS[name], dtype=HALF)
    fbgemm.gate.defer = True  # every backward held for step() (as under manual optimization)
    got = _train(fbgemm, True, weighted=False)
    expected = _train(TorchKernel(SHAPES, SLOT_SHARDS, True, CONFIGS[name], dtype=HALF), True, weighted=False)
    for (_, rows, states), (_, rows_t, states_t) in zip(got, expected, strict=True):
        assert all(torch.equal(w, w_t) for w, w_t in zip(rows, rows_t, strict=True))
        assert all(torch.equal(s, s_t) for s, s_t in zip(states, states_t, strict=True))
    assert any(not torch.equal(w, start) for w, start in zip(got[-1][1], _initial_weights(), strict=True))


# ----------------------------------------------------------------------------- kernels by dtype
def test_tables_of_different_dtypes_go_to_different_kernels():
    tables = [EmbeddingTableConfig("a", 40, 8, ["fa"]), EmbeddingTableConfig("b", 40, 8, ["fb"], dtype="fp16"),
              EmbeddingTableConfig("c", 40, 8, ["fc"])]
    plan = place_tables([(t.name, t.num_embeddings, t.embedding_dim) for t in tables], 1)
    spec = ShardingSpec(groups=MeshGroups.single_process())
    parts = tables_by_part(tables, plan, spec)
    assert [(key[2], [t.name for t in part]) for key, part in parts.items()] == [("fp32", ["a", "c"]),
                                                                                 ("fp16", ["b"])]


def test_the_plan_and_the_set_up_line_show_a_tables_dtype_where_not_fp32():
    tables = [EmbeddingTableConfig("a", 40, 8, ["fa"]), EmbeddingTableConfig("b", 40, 8, ["fb"], dtype="fp16")]
    twin = shard_collection(EmbeddingBagCollection(tables), ShardingSpec(MeshGroups.single_process(), backend="torch"))
    text = twin.describe_plan()
    assert "\n  b (fp16) " in text and "\n  a " in text and "fp32" not in text, text
    specs = {"m": [TableSpec.from_config(t) for t in tables]}
    report = evaluate(specs, {"m": dict(twin.plan, **twin.siblings[0].plan)}, 1, Workload(batch_size=4))
    assert report.ranks[0].tables == ("a", "b[fp16]")


def test_a_torchrec_fp16_table_keeps_fp16_rows_in_its_twin():
    pytest.importorskip("torchrec")
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecBags

    from lightning_twod.sparse.torchrec_modules import table_configs, torchrec_twin

    configs = [EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=8, feature_names=["fa"]),
               EmbeddingBagConfig(name="b", num_embeddings=40, embedding_dim=8, feature_names=["fb"],
                                  data_type=DataType.FP16)]
    module = TorchRecBags(tables=configs)
    assert [t.dtype for t in table_configs(module)] == ["fp32", "fp16"]
    twin = torchrec_twin(module, ShardingSpec(MeshGroups.single_process(), backend="torch"))
    state = twin.state_dict()
    for key, value in module.state_dict().items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    assert state["embedding_bags.b.weight"].dtype == HALF
    int8 = TorchRecBags(tables=[EmbeddingBagConfig(name="c", num_embeddings=4, embedding_dim=8, feature_names=["fc"],
                                                   data_type=DataType.INT8)])
    with pytest.raises(ValueError, match="TorchRec table 'c' has data_type=INT8; .* use DataType.FP32 or DataType.FP16"):
        table_configs(int8)


def test_the_replica_digest_tells_an_fp16_row_one_ulp_off_at_any_width():
    weights = torch.rand(30, 7).half()  # an odd width: no int32 view of its bits
    base = digest(weights)
    assert torch.equal(digest(weights.clone()), base)
    nudged = weights.clone()
    nudged.view(torch.int16)[3, 5] += 1  # the next fp16 value
    assert nudged[3, 5] != weights[3, 5]
    assert not torch.equal(digest(nudged), base)
    assert not torch.equal(digest(weights[[1, 0, *range(2, 30)]]), base), "rows swapped between positions"


# ----------------------------------------------------------------------------- the traffic model
@pytest.mark.parametrize("pooled, weighted", [(False, False), (False, True), (True, False)],
                         ids=["sequence", "weighted sequence", "pooled"])
def test_the_traffic_model_sends_unweighted_fp16_rows_home_at_2_bytes_and_their_gradients_at_comm_bytes(
        pooled, weighted):
    plan = place_tables([("t", 1000, 16)], 2, {"t": "row_wise"})

    def traffic(dtype: str, comm_bytes: int = 4) -> dict[str, float]:
        spec = TableSpec("t", 1000, 16, pooling_factor=3.0, pooled=pooled, weighted=weighted,
                         row_bytes=ROW_BYTES[dtype])
        return predict_traffic([spec], plan, 2, 1, Workload(batch_size=8, comm_bytes=comm_bytes))[0]

    fp32, fp16 = traffic("fp32"), traffic("fp16")
    assert fp32["output_dist"] > 0 and fp32["output_dist_grad"] > 0
    assert fp16["output_dist_grad"] == fp32["output_dist_grad"]
    exact = not pooled and not weighted  # rows the fp16 wire holds exactly (sparse.output_dist.sequence_wire_dtype)
    assert fp16["output_dist"] == (fp32["output_dist"] / 2 if exact else fp32["output_dist"])
    low = traffic("fp16", comm_bytes=2)  # a bf16 comm_dtype halves the gradients, never the rows' 2 bytes
    assert low["output_dist"] == fp16["output_dist"] / (1 if exact else 2)
    assert low["output_dist_grad"] == fp32["output_dist_grad"] / 2


# ----------------------------------------------------------------------------- the emulator's fp16 sum
class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection([EmbeddingTableConfig("t", 64, 16, ["f"], dtype="fp16")])
        self.dense = torch.nn.Linear(16, 1)


@pytest.mark.parametrize("replicas", [2, 8])
def test_the_emulators_fp16_sum_adds_the_copies_rows_in_fp16_one_after_another(replicas):
    generator = torch.Generator().manual_seed(0)
    copies = [(torch.rand(64, 16, generator=generator) * 0.3).half() for _ in range(replicas)]
    states = [torch.rand(64, generator=generator) for _ in range(replicas)]  # row-wise AdaGrad's fp32 sums
    summed = copies[0].clone()
    for copy in copies[1:]:
        summed += copy
    summed /= replicas
    mean = torch.stack([copy.float() for copy in copies]).mean(dim=0)
    reduced = {}
    for sum_dtype in ("fp32", "fp16"):
        emulator = MeshEmulator(_Model(), EmulatedLayout(replicas, 1), SparseOptimizerConfig("rowwise_adagrad", 0.1),
                                lambda model, batch: None, lambda params: torch.optim.SGD(params, lr=0.1),
                                sum_dtype=sum_dtype)
        key = "sparse.embedding_bags.t.weight"
        emulator.copies[key] = [copy.clone() for copy in copies]
        (name, per_copy), = emulator.states[key].items()
        per_copy[:] = [state.clone() for state in states]
        emulator.reduce()
        reduced[sum_dtype] = emulator.copies[key][0]
        assert all(torch.equal(copy, reduced[sum_dtype]) for copy in emulator.copies[key])
        assert all(torch.equal(s, torch.stack(states).mean(dim=0)) for s in emulator.states[key][name])  # fp32 state
    assert reduced["fp16"].dtype == reduced["fp32"].dtype == HALF
    assert torch.equal(reduced["fp32"], mean.half())  # the mean rounded once
    assert torch.equal(reduced["fp16"], summed)  # the sum rounded at every addition
    # 2 copies: one rounding either way; 8: seven roundings of the sums move some rows by an ulp or more
    assert torch.equal(reduced["fp16"], reduced["fp32"]) == (replicas == 2)


def test_the_emulator_refuses_another_sum_dtype_naming_the_choices():
    with pytest.raises(ValueError, match=r"MeshEmulator: sum_dtype='bf16'; use 'fp32' .* or 'fp16'"):
        MeshEmulator(_Model(), EmulatedLayout(2, 1), SparseOptimizerConfig("sgd", 0.1), lambda model, batch: None,
                     lambda params: torch.optim.SGD(params, lr=0.1), sum_dtype="bf16")


# ----------------------------------------------------------------------------- plain torch modules
class _Plain(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bags = torch.nn.EmbeddingBag(50, 8, mode="sum").to(dtype)
        self.rows = torch.nn.Embedding(40, 4).to(dtype)
        self.full = torch.nn.EmbeddingBag(30, 4, mode="mean")  # fp32 beside them


def test_a_plain_fp16_module_becomes_an_fp16_table_that_returns_fp16_as_the_module_did():
    model = _Plain(HALF)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    assert {t.dtype for t in embedding_tables(model)["bags"] + embedding_tables(model)["rows"]} == {"fp16"}
    assert [t.dtype for t in embedding_tables(model)["full"]] == ["fp32"]
    ids = torch.tensor([[1, 2, 2], [29, 0, 7]])
    weights = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.25, 1.0]], dtype=HALF)
    bags = torch.nn.functional.embedding_bag(ids, before["bags.weight"].float(), per_sample_weights=weights.float(),
                                             mode="sum").half()  # summed in fp32, rounded once
    twins = shard_model(model, ShardingSpec(MeshGroups.single_process(), SparseOptimizerConfig("sgd", lr=0.5),
                                            backend="torch"))
    assert [t.dtype for t in twins["bags"].tables] == ["fp16"] and twins["full"].tables[0].dtype == "fp32"
    for path in ("bags", "rows"):
        (key, weight), = twins[path].state_dict().items()
        assert weight.dtype == HALF and torch.equal(weight, before[f"{path}.weight"]), path
        assert all(w.dtype == HALF for _, w in twins[path].local_shards())
    out = model.bags(ids, per_sample_weights=weights)
    rows = model.rows(ids)
    assert out.dtype == rows.dtype == HALF and model.full(ids).dtype == torch.float32
    assert torch.equal(out, bags)
    assert torch.equal(rows, before["rows.weight"][ids])
    (out.float().sum() + rows.float().sum()).backward()
    for twin in (twins["bags"], twins["rows"]):
        for kernel in twin.kernels():
            kernel.step()
    for path in ("bags", "rows"):
        (key, weight), = twins[path].state_dict().items()
        assert weight.dtype == HALF and not torch.equal(weight, before[f"{path}.weight"]), f"{path} did not train"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_plain_module_in_another_dtype_is_refused_naming_it_and_the_fix(dtype):
    model = _Plain(dtype)
    message = rf"EmbeddingBag 'bags' has a {dtype} weight; sharded tables keep fp32 or fp16 rows: convert it"
    with pytest.raises(ValueError, match=message):
        embedding_tables(model)
    with pytest.raises(ValueError, match=message):
        shard_model(model, ShardingSpec(MeshGroups.single_process(), backend="torch"))
    assert isinstance(model.bags, torch.nn.EmbeddingBag), "the model is changed only once every twin is built"
