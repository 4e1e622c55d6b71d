"""The Adam family's wiring through the layers, with no process: the options that configure it, the
planner's account of its state, which of its states a replica round sends on the wire and which in
fp32, the digests of every state, and the checkpoint keys of each state."""

from __future__ import annotations

import pytest
import torch

from lightning_twod.checkpoint.directory import MOMENTUM, state_suffix
from lightning_twod.planner.inputs import Workload
from lightning_twod.replication.reducer import _shard_tensors
from lightning_twod.replication.verify import STATE, state_kind
from lightning_twod.sparse.kernels import ShardShape, TorchKernel
from lightning_twod.sparse.optimizers import ADAM_OPTIMIZERS, OPTIMIZERS, SparseOptimizerConfig, layout_optimizer
from lightning_twod.strategies.options import TwoDOptions
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator
from tests.unit.test_layout_arithmetic import OneRowNet, _one_row_batches

SHAPES = [ShardShape(10, 8), ShardShape(6, 4)]


@pytest.mark.parametrize("name", [*OPTIMIZERS, *ADAM_OPTIMIZERS])
@pytest.mark.parametrize("dim", [1, 8, 64])
def test_the_planner_counts_the_state_the_kernels_keep(name, dim):
    config = SparseOptimizerConfig(name)
    shapes = config.state_shapes(1, dim)
    workload = Workload(optimizer=name)
    assert workload.state_per_row(dim) == sum(shape[-1] if len(shape) == 2 else 1 for shape in shapes.values())
    exact = sum(shapes[n][-1] if len(shapes[n]) == 2 else 1 for n in config.exact_states)
    assert workload.exact_state_per_row(dim) == exact
    assert workload.column_wise_exact == (name in ("sgd", "adam", "adamw"))


def test_adam_state_per_row_as_documented():
    assert Workload(optimizer="adam").state_per_row(16) == 33 == Workload(optimizer="lamb").state_per_row(16)
    assert Workload(optimizer="rowwise_adam").state_per_row(16) == 18
    assert Workload(optimizer="rowwise_adagrad").state_per_row(16) == 1


@pytest.mark.parametrize("name", ADAM_OPTIMIZERS)
def test_a_round_sends_the_moments_on_the_wire_and_v_and_step_in_fp32(name):
    kernel = TorchKernel(SHAPES, [0, 1], True, SparseOptimizerConfig(name))
    states = kernel.shard_states()
    for k, (weight, shard) in enumerate(zip(kernel.weights(), states, strict=True)):
        everything = _shard_tensors(kernel)[k]
        wire, exact = _shard_tensors(kernel, "wire")[k], _shard_tensors(kernel, "exact")[k]
        assert [t.data_ptr() for t in everything] == [t.data_ptr() for t in (weight, *shard.values())]
        assert [t.data_ptr() for t in wire] == [weight.data_ptr(), shard["momentum1"].data_ptr()]
        assert [t.data_ptr() for t in exact] == [shard["momentum2"].data_ptr(), shard["step"].data_ptr()]
        assert all(t.dim() == 2 and t.shape[0] == SHAPES[k].rows for t in everything)


def test_row_wise_adagrad_sends_its_accumulator_on_the_wire():
    kernel = TorchKernel(SHAPES, [0, 1], True, SparseOptimizerConfig("rowwise_adagrad"))
    assert SparseOptimizerConfig("rowwise_adagrad").exact_states == ()
    assert [len(t) for t in _shard_tensors(kernel, "wire")] == [2, 2]
    assert [t.shape for t in _shard_tensors(kernel)[0]] == [(10, 8), (10, 1)]


def test_each_state_has_its_key_and_its_name_in_errors():
    assert state_suffix("momentum_rowwise_adagrad", "momentum1") == MOMENTUM == ".momentum"
    assert [state_suffix("rowwise_adam", n) for n in ("momentum1", "momentum2", "step")] == \
        [".momentum1", ".momentum2", ".step"]
    assert state_kind(SparseOptimizerConfig("rowwise_adagrad"), "momentum1") == STATE
    assert state_kind(SparseOptimizerConfig("adam"), "step") == "optimizer state step"


def test_options_pass_betas_and_weight_decay_to_the_optimizer():
    options = TwoDOptions(sparse_optimizer="adamw", sparse_betas=[0.8, 0.99], sparse_weight_decay=0.01)
    assert options.sparse_betas == (0.8, 0.99)
    config = layout_optimizer(options.sparse_optimizer, 0.1, 1e-8, "auto", data_parallel=False, world_size=4,
                              shard_group_size=2, sync_mode="weights", betas=options.sparse_betas,
                              weight_decay=options.sparse_weight_decay)
    assert (config.name, config.beta1, config.beta2, config.weight_decay) == ("adamw", 0.8, 0.99, 0.01)
    assert config.accumulator_scale == 1.0  # no layout factor enters the Adam family's step


@pytest.mark.parametrize("name", ["rowwise_adam", "lamb"])
def test_column_wise_is_refused_where_the_optimizer_reads_whole_rows(name):
    with pytest.raises(ValueError, match=rf"sharding asks for table 'item' column_wise but sparse_optimizer='{name}'"
                                         r".*table_wise, row_wise or data_parallel, or use 'adam' or 'adamw'"):
        TwoDOptions(sparse_optimizer=name, sharding={"item": "column_wise"})
    with pytest.raises(ValueError, match=rf"allow_column_wise=True but sparse_optimizer='{name}'"):
        TwoDOptions(sparse_optimizer=name, allow_column_wise=True)
    TwoDOptions(sparse_optimizer="adam", sharding={"item": "column_wise"}, allow_column_wise=True)


# ----------------------------------------------------------------------------- what the replicas' mean is
def _adam_row(world: int, group: int, steps: int, ranks: int, name: str) -> dict[str, float]:
    """Row 7 of the sharded table (read by one rank's sample a step, ``test_layout_arithmetic``'s model)
    after ``steps`` steps on the emulated layout (``ranks=1``: one process, 1D): its step count, its
    bias-corrected moments (norms) and how far it moved."""
    net = OneRowNet()
    key = "sparse.embedding_bags.sharded.weight"
    start = net.state_dict()[key][7].clone()
    config = layout_optimizer(name, 0.001, 1e-8, "auto", data_parallel=False, world_size=ranks,
                              shard_group_size=group, sync_mode="weights")
    emulator = MeshEmulator(net, EmulatedLayout(ranks, group), config, lambda model, batch: model.loss(batch),
                            lambda params: torch.optim.SGD(params, lr=0.0))
    for step in range(steps):
        emulator.step(_one_row_batches(world, step, ranks))
    states = {n: per_copy[0][7] for n, per_copy in emulator.states[key].items()}
    t = float(states["step"])
    return {"step": t, "m": float(states["momentum1"].norm()) / (1 - config.beta1 ** t),
            "v": float(states["momentum2"].sum()) / (1 - config.beta2 ** t),
            "moved": float((net.state_dict()[key][7] - start).norm())}


@pytest.mark.parametrize("name", ["adam", "rowwise_adam"])
@pytest.mark.parametrize(("world", "group"), [(4, 2), (4, 1)])
def test_the_replicas_mean_of_adam_states_for_a_row_one_copy_reads(name, world, group):
    """What ``concepts.md`` states, measured over 50 steps: the mean ``step`` grows ``1 / M`` a step, the
    bias-corrected ``v`` is ``M**2`` times 1D's, ``m`` here (random targets: the row's gradient changes
    sign) about 1D's, and the row moves about ``M**-1.5`` of 1D's distance."""
    replicas, steps = world // group, 50
    one_d, layout = _adam_row(world, 1, steps, 1, name), _adam_row(world, group, steps, world, name)
    assert one_d["step"] == steps and layout["step"] == steps / replicas
    ratio = {k: layout[k] / one_d[k] for k in ("m", "v", "moved")}
    assert abs(ratio["v"] / replicas**2 - 1) < 0.02, ratio
    assert abs(ratio["m"] - 1) < 0.05, ratio
    assert abs(ratio["moved"] * replicas**1.5 - 1) < 0.1, ratio
