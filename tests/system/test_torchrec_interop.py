"""TorchRec interop against the real thing (torchrec 1.8.0, installed without its dependencies).

* Our collections and their twins take a ``KeyedJaggedTensor``; ``PooledEmbeddings`` answers like
  TorchRec's ``KeyedTensor``; ``to_kjt``/``from_kjt`` round-trip real KJTs.
* A model written with ``torchrec.modules.EmbeddingBagCollection`` / ``EmbeddingCollection`` and
  ``EmbeddingBagConfig`` is sharded unchanged: on a 2x2 mesh of gloo processes, the twins' outputs
  (TorchRec's own types) and per-row gradients equal the unsharded TorchRec model's, and a Lightning
  fit under ``TwoDSparseStrategy`` trains what plain torch trains on the global batches; with input-dist
  pipelining (the strategy finds the batch's KJT) bit for bit what it trains without.
* Without a TorchRec model nothing imports torchrec.
"""

from __future__ import annotations

import subprocess
import sys

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    EmbeddingTableConfig,
    SparseFeatures,
    TwoDSparseStrategy,
)
from lightning_twod.distributed import MeshGroups, SparseParallelDims
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_model
from tests.helpers import strategy_cases as C
from tests.helpers.distributed import run_distributed

torchrec = pytest.importorskip("torchrec", reason="needs torchrec (requirements/torchrec.txt)")
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchRecEC  # noqa: E402
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: E402

ATOL = 1e-5
BAG_FEATURES = {"a": 30, "b": 20, "c": 20}  # "b" and "c" read one (mean-pooled) table
SEQUENCE_FEATURES = {"s": 25}


def torchrec_ebc(seed: int = 0) -> TorchRecEBC:
    torch.manual_seed(seed)
    return TorchRecEBC(tables=[
        EmbeddingBagConfig(name="t_a", num_embeddings=30, embedding_dim=8, feature_names=["a"]),
        EmbeddingBagConfig(name="t_bc", num_embeddings=20, embedding_dim=4, feature_names=["b", "c"],
                           pooling=PoolingType.MEAN),
    ], device=torch.device("cpu"))


def torchrec_ec(seed: int = 1) -> TorchRecEC:
    torch.manual_seed(seed)
    return TorchRecEC(tables=[EmbeddingConfig(name="t_s", num_embeddings=25, embedding_dim=4, feature_names=["s"])],
                      device=torch.device("cpu"))


def random_kjt(features: dict[str, int], batch: int, seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(features) * batch,), generator=gen)
    values = torch.cat([torch.randint(0, rows, (int(n),), generator=gen)
                        for f, (name, rows) in enumerate(features.items()) for n in lengths[f * batch:(f + 1) * batch]])
    return KeyedJaggedTensor(keys=list(features), values=values, lengths=lengths)


def rank_part(kjt: KeyedJaggedTensor, sizes: list[int], rank: int) -> KeyedJaggedTensor:
    return SparseFeatures.from_kjt(kjt).split_batch(sizes)[rank].to_kjt()


# ----------------------------------------------------------------------------- one process
def test_our_collections_take_a_keyed_jagged_tensor():
    kjt = random_kjt({"a": 30, "b": 20}, 5, seed=0)
    bags = EmbeddingBagCollection([EmbeddingTableConfig("t_a", 30, 8, ["a"]), EmbeddingTableConfig("t_b", 20, 4, ["b"])])
    from_kjt = bags(kjt)
    assert torch.equal(from_kjt.values(), bags(SparseFeatures.from_kjt(kjt)).values())
    rows = EmbeddingCollection([EmbeddingTableConfig("t_a", 30, 8, ["a"], pooling="none"),
                                EmbeddingTableConfig("t_b", 20, 4, ["b"], pooling="none")])
    assert torch.equal(rows(kjt)["b"].values, rows(SparseFeatures.from_kjt(kjt))["b"].values)
    with pytest.raises(TypeError, match="takes SparseFeatures or a TorchRec KeyedJaggedTensor, got dict"):
        bags({"a": [1]})


def test_kjt_round_trip_and_pooled_embeddings_answer_like_a_keyed_tensor():
    kjt = random_kjt({"a": 30, "b": 20}, 4, seed=2)
    features = SparseFeatures.from_kjt(kjt)
    back = features.to_kjt()
    assert isinstance(back, KeyedJaggedTensor) and back.keys() == kjt.keys()
    assert torch.equal(back.values(), kjt.values()) and torch.equal(back.lengths(), kjt.lengths())

    bags = EmbeddingBagCollection([EmbeddingTableConfig("t_a", 30, 8, ["a"]), EmbeddingTableConfig("t_b", 20, 4, ["b"])])
    ours = bags(kjt)
    theirs = KeyedTensor(keys=ours.keys(), length_per_key=ours.length_per_key(), values=ours.values())
    assert ours.keys() == theirs.keys() and ours.length_per_key() == theirs.length_per_key()
    assert torch.equal(ours.values(), theirs.values())
    for key, value in theirs.to_dict().items():
        assert torch.equal(ours.to_dict()[key], value) and torch.equal(ours[key], theirs[key])


def test_a_torchrec_model_shards_on_one_process_into_torchrec_types():
    model = nn.ModuleDict({"bags": torchrec_ebc(), "rows": torchrec_ec()})
    kjt_bags, kjt_rows = random_kjt(BAG_FEATURES, 6, seed=3), random_kjt(SEQUENCE_FEATURES, 6, seed=4)
    want_bags, want_rows = model["bags"](kjt_bags), model["rows"](kjt_rows)
    keys = set(model.state_dict())
    shard_model(model, ShardingSpec(MeshGroups.single_process(), backend="torch"))
    got_bags, got_rows = model["bags"](kjt_bags), model["rows"](kjt_rows)
    assert isinstance(got_bags, KeyedTensor) and isinstance(got_rows["s"], JaggedTensor)
    assert got_bags.keys() == want_bags.keys() == ["a", "b", "c"]
    torch.testing.assert_close(got_bags.values(), want_bags.values(), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_rows["s"].values(), want_rows["s"].values(), atol=ATOL, rtol=0)
    assert torch.equal(got_rows["s"].lengths(), want_rows["s"].lengths())
    assert set(model.state_dict()) == keys, "the sharded model keeps TorchRec's state_dict keys"


def test_nothing_imports_torchrec_without_a_torchrec_model():
    code = ("import sys, torch, lightning_twod\n"
            "from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures\n"
            "from lightning_twod.sparse.sharded import ShardingSpec\n"
            "from lightning_twod.sparse.wrap import shard_model\n"
            "from lightning_twod.distributed import MeshGroups\n"
            "model = torch.nn.ModuleDict({'e': EmbeddingBagCollection([EmbeddingTableConfig('t', 10, 4, ['f'])])})\n"
            "shard_model(model, ShardingSpec(MeshGroups.single_process(), backend='torch'))\n"
            "model['e'](SparseFeatures.from_dict({'f': [[1], [2, 3]]}))\n"
            "assert 'torchrec' not in sys.modules, sorted(m for m in sys.modules if 'torchrec' in m)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# ----------------------------------------------------------------------------- 2x2, gloo
def _equivalence_worker(rank: int, world: int, sizes: list[int]) -> int:
    groups = MeshGroups.create(SparseParallelDims(world, 2))
    reference = nn.ModuleDict({"bags": torchrec_ebc(), "rows": torchrec_ec()})
    model = nn.ModuleDict({"bags": torchrec_ebc(), "rows": torchrec_ec()})
    twins = shard_model(model, ShardingSpec(groups, backend="torch"))
    bags, rows = random_kjt(BAG_FEATURES, sum(sizes), seed=5), random_kjt(SEQUENCE_FEATURES, sum(sizes), seed=6)
    local_bags, local_rows = rank_part(bags, sizes, rank), rank_part(rows, sizes, rank)
    out_bags, out_rows = model["bags"](local_bags), model["rows"](local_rows)
    torch.testing.assert_close(out_bags.values(), reference["bags"](local_bags).values(), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_rows["s"].values(), reference["rows"](local_rows)["s"].values(), atol=ATOL, rtol=0)

    # gradients of a weighted sum over the global batch: each copy gets its group's part
    gen = torch.Generator().manual_seed(7)
    global_bags, global_rows = reference["bags"](bags).values(), reference["rows"](rows)["s"].values()
    w_bags, w_rows = torch.randn(global_bags.shape, generator=gen), torch.randn(global_rows.shape, generator=gen)
    ((global_bags * w_bags).sum() + (global_rows * w_rows).sum()).backward()
    start = sum(sizes[:rank])
    row_start = sum(SparseFeatures.from_kjt(rank_part(rows, sizes, r)).num_values for r in range(rank))
    local_loss = (out_bags.values() * w_bags[start:start + sizes[rank]]).sum()
    local_loss += (out_rows["s"].values() * w_rows[row_start:row_start + out_rows["s"].values().shape[0]]).sum()
    local_loss.backward()
    checked = 0
    for path, twin in twins.items():
        for kernel, shards in twin.kernel_shards():
            for shard, param in zip(shards, kernel.shard_weights, strict=True):
                grad = param.grad.to_dense() if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad, group=groups.replica)  # the copies' gradients together: the global one
                table = getattr(reference[path], twin.prefix)[shard.table].weight.grad
                expected = table[shard.row_start:shard.row_end, shard.col_start:shard.col_end]
                torch.testing.assert_close(grad, expected, atol=ATOL, rtol=0)
                checked += 1
    return checked


def test_a_torchrec_model_sharded_on_2x2_equals_the_unsharded_one():
    checked = run_distributed(_equivalence_worker, 4, [3, 2, 4, 1])
    assert sum(checked) >= 3, "every table's shards were compared"


class TorchRecDLRM(pl.LightningModule):
    """A model written with TorchRec's modules only: a KeyedTensor feeds a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = torchrec_ebc()
        torch.manual_seed(2)
        self.head = nn.Linear(8 + 4 + 4, 1)

    def loss(self, batch) -> torch.Tensor:
        pooled = self.bags(batch["kjt"])  # KeyedTensor: torchrec's own type
        logits = self.head(torch.cat([pooled["a"], pooled["b"], pooled["c"]], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch["y"])

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)

    def train_dataloader(self):
        dataset = list(range(4 * 4 * 5))
        sampler = DistributedSampler(dataset, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=_collate)


def _collate(indices: list[int]) -> dict:
    kjts = [SparseFeatures.from_kjt(random_kjt(BAG_FEATURES, 1, seed=100 + i)) for i in indices]
    gen = torch.Generator().manual_seed(indices[0])
    return {"kjt": SparseFeatures.concat_batches(kjts).to_kjt(),
            "y": (torch.rand(len(indices), generator=gen) < 0.5).float()}


def _fit_worker(rank: int, world: int, port: int, sharding: dict | None) -> dict:
    C.as_external_rank(rank, world, port)
    lit = TorchRecDLRM()
    strategy = TwoDSparseStrategy(shard_group_size=2, sparse_optimizer="sgd", sparse_lr=0.3, sync_interval=1,
                                  sharding=sharding)
    trainer = pl.Trainer(devices=world, strategy=strategy, **C.trainer_kwargs(5))
    trainer.fit(lit)
    assert len(strategy.sparse_modules["bags"].parts()) == (2 if sharding else 1)
    return C.numpy_state(lit.state_dict())


# the global 2x2 mesh, and table t_a 1D while the other table stays in groups of 2 (a twin of two parts)
@pytest.mark.parametrize("sharding", [None, {"t_a": {"shard_group_size": 4}}], ids=["2x2", "per-table"])
def test_a_torchrec_model_trains_under_the_strategy_as_plain_torch_does(sharding):
    got = run_distributed(_fit_worker, 4, C.free_port(), sharding, timeout=300)[0]
    reference = TorchRecDLRM()
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.3)
    for step in range(5):  # the global batch of step t: samples t*16 .. t*16+15, in rank order
        indices = [r + 4 * i for r in range(4) for i in range(step * 4, step * 4 + 4)]
        batches = [_collate([i for i in indices[r * 4:(r + 1) * 4]]) for r in range(4)]
        optimizer.zero_grad()
        sum(reference.loss(b) for b in batches).div(4).backward()
        optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(torch.as_tensor(got[key]), value, atol=ATOL, rtol=0, msg=key)
    assert (reference.state_dict()["bags.embedding_bags.t_a.weight"] - initial["bags.embedding_bags.t_a.weight"]
            ).abs().max() > 1e-3


class _PipelineCounts(pl.Callback):
    """``(used, missed)`` of the strategy's input pipeline at the end of fit (None: not pipelined)."""

    seen = None

    def on_train_end(self, trainer, pl_module) -> None:
        pipe = trainer.strategy.input_pipeline
        self.seen = None if pipe is None else (pipe.used, pipe.missed)


def _pipeline_worker(rank: int, world: int, port: int) -> dict:
    C.as_external_rank(rank, world, port)
    out = {}
    for pipeline in (False, True):
        lit = TorchRecDLRM()
        strategy = TwoDSparseStrategy(shard_group_size=2, sparse_optimizer="sgd", sparse_lr=0.3, pipeline=pipeline)
        counts = _PipelineCounts()
        trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[counts], **C.trainer_kwargs(5))
        trainer.fit(lit)
        out[pipeline] = {"state": C.numpy_state(lit.state_dict()), "counts": counts.seen}
    return out


def test_a_torchrec_model_fed_keyed_jagged_tensors_is_pipelined_bit_identically():
    for result in run_distributed(_pipeline_worker, 4, C.free_port(), timeout=300):
        assert result[True]["counts"] == (4, 0)  # the first step learns where the KJT is; 4 sent ahead
        for key, value in result[False]["state"].items():
            np.testing.assert_array_equal(result[True]["state"][key], value, err_msg=key)
