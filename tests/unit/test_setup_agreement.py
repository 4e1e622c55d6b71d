"""Set-up checks on one process: the cgroup memory limit, modules the twins cannot represent, per-id
weights that require grad, and errors and values passed through when there is one process (the
agreement across ranks: ``tests/system/test_setup_agreement.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures
from lightning_twod.distributed import MeshGroups, consensus
from lightning_twod.hardware.machine import cgroup_memory_limit
from lightning_twod.sparse.sharded import ShardingSpec
from lightning_twod.sparse.wrap import shard_model


# ----------------------------------------------------------------------------- 3. one process
def test_cgroup_memory_limit_is_read(tmp_path):
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text("max\n")
    assert cgroup_memory_limit([v2]) is None
    v2.write_text("2147483648\n")
    assert cgroup_memory_limit([v2]) == 2**31
    v1.write_text(str(2**63 - 4096))  # cgroup v1's "no limit"
    assert cgroup_memory_limit([tmp_path / "missing", v1]) is None


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # an output layer tied to the table


@pytest.mark.parametrize(("build", "match"), [
    (lambda: nn.ModuleDict({"emb": nn.Embedding(10, 4, scale_grad_by_freq=True)}),
     r"Embedding 'emb' has scale_grad_by_freq=True.*set scale_grad_by_freq=False"),
    (lambda: nn.ModuleDict({"bag": nn.EmbeddingBag(10, 4, mode="sum", scale_grad_by_freq=True)}),
     r"EmbeddingBag 'bag' has scale_grad_by_freq=True"),
    (TiedModel, r"the embedding weight 'emb.weight' is tied to \['out.weight'\].*untie them"),
])
def test_modules_the_twins_cannot_represent_fail_naming_the_attribute(build, match):
    model = build()
    with pytest.raises(ValueError, match=match):
        shard_model(model, ShardingSpec(MeshGroups.single_process(), backend="torch"))
    assert not any("Sharded" in type(m).__name__ for m in model.modules()), "nothing was swapped"


def test_per_id_weights_that_require_grad_are_refused():
    model = nn.ModuleDict({
        "sparse": EmbeddingBagCollection([EmbeddingTableConfig("t", 10, 4, ["f"])]),
        "bag": nn.EmbeddingBag(10, 4, mode="sum"),
    })
    shard_model(model, ShardingSpec(MeshGroups.single_process(), backend="torch"))
    weights = torch.ones(3, requires_grad=True)
    features = SparseFeatures(["f"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]), weights)
    with pytest.raises(ValueError, match=r"'sparse': the per-id weights of features \['f'\] require grad"):
        model["sparse"](features)
    with pytest.raises(ValueError, match=r"ShardedEmbeddingBag 'bag': the per-id weights"):
        model["bag"](torch.tensor([1, 2, 3]), torch.tensor([0, 2]), per_sample_weights=weights)
    assert model["sparse"](SparseFeatures(["f"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]),
                                          weights.detach())).values().shape == (2, 4)


def test_one_process_passes_errors_and_values_through():
    with pytest.raises(KeyError, match="nope"):
        with consensus.raise_on_every_rank(None):
            raise KeyError("nope")
    assert consensus.agree_min([3.0], None) == [3.0]
    consensus.check_same("plan", "anything", None)  # nothing to compare with
