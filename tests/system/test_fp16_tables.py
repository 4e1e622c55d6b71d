"""fp16 tables through ``TwoDSparseStrategy`` on 2 and 4 gloo processes against one process.

The tests' DLRM with ``t_item`` (row-wise, shared by two features) and ``t_cat`` (data-parallel) in fp16,
``t_user`` (table-wise) in fp32: the fp16 tables train in kernels of their own. Every fit equals one process
trained on the concatenated batches (the same strategy on a 1x1 mesh) within fp16 rounding:

* SGD, averaged every step (``sync_mode="weights"``): on 2x1, 1x2 and 2x2 meshes; on 2x2 also with FBGEMM's
  fused fp16 kernel (stochastic rounding);
* row-wise AdaGrad and row-wise Adam in ``sync_mode="gradients"`` (1D's semantics) on 2x2.

With SGD averaged every step, a replica's update rounds its rows to fp16 before the copies are averaged
(and the mean is rounded again), where one process rounds once: the fp16 rows differ from one process's by
up to an fp16 ulp a step (``FP16_TOLERANCE``; measured: 1.5 ulps after 4 steps), and the fp32 tensors, which
see pooled rows that differ by those roundings, by far less (``FP32_TOLERANCE``; measured: 1e-5). In
``sync_mode="gradients"`` the copies apply the averaged fp32 gradient and round once, as one process does
(measured: equal). Every tensor moves more than ten times its tolerance.

On the reduction's wires (``replication.wire``: an fp16 table's rows go in a round of their own, as fp16,
whatever the wire), row-wise AdaGrad averaged every 2 steps on 2x2 equals the emulator: on the fp32 wire
overlapped, the bf16 wire overlapped and the int8 wire, the copies bit-identical after the end of fit's drain.
The strategy sums fp16 rows in fp16 over the copies, the emulator rounds their mean once: equal for the 2
copies of ``t_item``, within an fp16 ulp a round for the 4 of ``t_cat``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, TwoDSparseStrategy
from lightning_twod.sparse.optimizers import layout_optimizer
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

STEPS = 4
LR = 0.2  # dense SGD
SPARSE_LR, EPS = 0.5, 1e-3
DTYPES = {"t_user": "fp32", "t_item": "fp16", "t_cat": "fp16"}
SHARDING = {"t_user": "table_wise", "t_item": "row_wise", "t_cat": "data_parallel"}
OPTIONS = {
    "sgd": dict(sparse_optimizer="sgd", kernel_backend="torch"),
    "sgd fbgemm": dict(sparse_optimizer="sgd", kernel_backend="fbgemm"),
    "rowwise_adagrad gradients": dict(sparse_optimizer="rowwise_adagrad", sync_mode="gradients",
                                      kernel_backend="torch", sparse_lr=0.05),
    "rowwise_adam gradients": dict(sparse_optimizer="rowwise_adam", sync_mode="gradients", kernel_backend="torch",
                                   sparse_lr=0.02),
}
WIRES = {
    "fp32 overlap": dict(sync_overlap=True),
    "bf16 overlap": dict(sync_dtype="bf16", sync_overlap=True),
    "int8": dict(sync_dtype="int8"),
}
WIRE_OPTIONS = dict(sparse_optimizer="rowwise_adagrad", sparse_lr=0.05, sync_interval=2, kernel_backend="torch")
# world size -> {mesh: (shard group size, fits)}
MESHES = {2: {"2x1": (1, ["sgd"]), "1x2": (2, ["sgd"])},
          4: {"2x2": (2, ["sgd", "sgd fbgemm", "rowwise_adagrad gradients", "rowwise_adam gradients"])}}
FP16_TOLERANCE = STEPS * 2.0 ** -12  # an fp16 ulp a step of rows in [0.25, 0.5) (they stay below 0.35)
FP32_TOLERANCE = 1e-4


def _net() -> C.CollectionNet:
    """The tests' DLRM with ``DTYPES``' tables, its fp32 rows rounded to nearest where fp16."""
    net = C.make_net("collection")
    tables = [EmbeddingTableConfig(name, rows, dim, feats, dtype=DTYPES[name]) for name, rows, dim, feats in C.TABLES]
    sparse = EmbeddingBagCollection(tables)
    sparse.load_state_dict(net.sparse.state_dict())
    net.sparse = sparse
    return net


def _fit(world: int, group: int, fit: str, batch_size: int = C.LOCAL_BATCH) -> dict:
    lit = C.LitDLRM(_net(), LR, batch_size=batch_size, num_samples=STEPS * world * C.LOCAL_BATCH)
    options = {"sparse_lr": SPARSE_LR, **OPTIONS[fit]} if fit in OPTIONS else {**WIRE_OPTIONS, **WIRES[fit]}
    strategy = TwoDSparseStrategy(shard_group_size=group, sharding=SHARDING, sparse_eps=EPS, **options)
    trainer = pl.Trainer(devices=world if batch_size == C.LOCAL_BATCH else 1, strategy=strategy,
                         **C.trainer_kwargs(STEPS))
    trainer.fit(lit)
    dtypes = [{shard.table: str(weight.dtype) for kernel, shards in part.kernel_shards()
               for shard, weight in zip(shards, kernel.weights(), strict=True)}
              for part in strategy.sparse_modules["net.sparse"].parts()]
    return dict(state=C.numpy_state(lit.net.state_dict()), identical=all(C.replicas_identical(strategy)),
                dtypes=dtypes, seen=lit.seen)


def _meshes_worker(rank: int, world: int, port: int) -> dict:
    C.as_external_rank(rank, world, port)
    out = {(mesh, fit): _fit(world, group, fit) for mesh, (group, fits) in MESHES[world].items() for fit in fits}
    if world == C.WORLD:
        out.update({("2x2", wire): _fit(world, 2, wire) for wire in WIRES})
    return out


def _single_worker(rank: int, world: int, port: int) -> dict:
    """One process on the concatenated batches of 2 and of 4 ranks."""
    C.as_external_rank(rank, world, port)
    return {(size, fit): _fit(size, 1, fit, batch_size=size * C.LOCAL_BATCH)
            for size, meshes in MESHES.items() for fit in {f for _, fits in meshes.values() for f in fits}
            if fit != "sgd fbgemm"}


@pytest.fixture(scope="module")
def fits() -> tuple[dict, dict]:
    single = run_distributed(_single_worker, 1, C.free_port(), timeout=600)[0]
    meshes = {}
    for world in MESHES:
        meshes.update(run_distributed(_meshes_worker, world, C.free_port(), timeout=600)[0])
    return single, meshes


def test_fp16_tables_train_in_fp16_kernels_of_their_own(fits):
    _, meshes = fits
    for (mesh, fit), result in meshes.items():
        parts = [part for part in result["dtypes"] if part]  # (a part may hold no shard on a rank)
        assert {"t_item": "torch.float16", "t_cat": "torch.float16"} in parts, (mesh, fit, parts)
        assert {"t_user": "torch.float32"} in parts or mesh == "1x2" and len(parts) == 1, (mesh, fit, parts)
        assert result["identical"], (mesh, fit)
        assert result["state"]["sparse.embedding_bags.t_item.weight"].dtype.name == "float16"
        assert result["state"]["sparse.embedding_bags.t_user.weight"].dtype.name == "float32"


@pytest.mark.parametrize("mesh, fit", [(mesh, fit) for meshes in MESHES.values()
                                       for mesh, (_, fits) in meshes.items() for fit in fits])
def test_a_fit_equals_one_process_on_the_concatenated_batch_within_fp16_rounding(fits, mesh, fit):
    single, meshes = fits
    world = next(w for w, m in MESHES.items() if mesh in m)
    got = meshes[(mesh, fit)]
    expected = single[(world, fit.replace(" fbgemm", ""))]
    samples = STEPS * world * C.LOCAL_BATCH
    assert sum(expected["seen"], []) == list(range(samples))
    assert sum(got["seen"], []) == list(range(0, samples, world))  # rank 0's: its share of every step
    start = _net().state_dict()
    for key, value in expected["state"].items():
        assert got["state"][key].dtype == value.dtype == start[key].numpy().dtype, key
        tolerance = FP16_TOLERANCE if value.dtype.name == "float16" else FP32_TOLERANCE
        a, b = torch.from_numpy(got["state"][key]).float(), torch.from_numpy(value).float()
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0, msg=lambda m, key=key: f"{mesh} {fit} {key}: {m}")
        moved = (b - start[key].float()).abs().max()
        assert moved > 10 * tolerance, (key, moved)


def _emulated(wire: str) -> dict[str, torch.Tensor]:
    """The model after ``STEPS`` steps and the end of fit of the emulator on the fit ``wire``'s layout."""
    options = WIRES[wire]
    layout = EmulatedLayout(C.WORLD, 2, "weights", WIRE_OPTIONS["sync_interval"], data_parallel=("t_cat",),
                            sync_dtype=options.get("sync_dtype", "fp32"), sync_overlap=options.get("sync_overlap", False))

    def config(data_parallel: bool):
        return layout_optimizer("rowwise_adagrad", WIRE_OPTIONS["sparse_lr"], EPS, "auto", data_parallel=data_parallel,
                                world_size=C.WORLD, shard_group_size=2, sync_mode="weights")

    emulator = MeshEmulator(_net(), layout, config(False), lambda model, batch: model.loss(batch),
                            lambda params: torch.optim.SGD(params, lr=LR), data_parallel_sparse=config(True))
    C.emulate_epoch(emulator, STEPS)
    return emulator.model.state_dict()


@pytest.mark.parametrize("wire", list(WIRES))
def test_fp16_rows_on_every_wire_stay_identical_and_equal_the_emulator(fits, wire):
    _, meshes = fits
    got = meshes[("2x2", wire)]
    assert got["identical"]
    start = _net().state_dict()
    for key, value in _emulated(wire).items():
        assert got["state"][key].dtype == value.numpy().dtype == start[key].numpy().dtype, key
        tolerance = FP16_TOLERANCE if value.dtype == torch.float16 else FP32_TOLERANCE
        if key == "sparse.embedding_bags.t_item.weight":  # 2 copies: an fp16 sum and a rounded mean agree
            tolerance = 0.0
        a = torch.from_numpy(got["state"][key]).float()
        torch.testing.assert_close(a, value.float(), atol=tolerance, rtol=0, msg=lambda m, key=key: f"{wire} {key}: {m}")
        assert (value.float() - start[key].float()).abs().max() > 10 * max(tolerance, FP32_TOLERANCE), key
