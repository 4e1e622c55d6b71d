"""Small parts of TorchRec's API that a TorchRec user reaches for, answered as TorchRec answers:
``offset_per_key()`` of a batch (``SparseFeatures`` or a ``KeyedJaggedTensor`` converted), a
collection's forward on the meta device (shapes only, the input check reading no ids) and a
collection's ``device``. Compared with TorchRec's own results where it is installed."""

from __future__ import annotations

import pytest
import torch

from lightning_twod import EmbeddingBagCollection, EmbeddingTableConfig, SparseFeatures
from lightning_twod.sparse.modules import EmbeddingCollection

EXAMPLE = {"user_id": [[1], [2, 3], []], "item_id": [[4], [], [5]]}
SKEWED = {"a": [[1, 2, 3, 4], [5]], "b": [[], []], "c": [[6], [7, 8]]}


def _tables(pooling: str = "sum") -> list[EmbeddingTableConfig]:
    return [EmbeddingTableConfig("user", 10, 4, ["user_id"], pooling=pooling),
            EmbeddingTableConfig("item", 6, 8, ["item_id"], pooling="mean" if pooling == "sum" else pooling)]


def test_offset_per_key_is_the_start_of_each_features_ids():
    features = SparseFeatures.from_dict(SKEWED)
    assert features.length_per_key() == [5, 0, 3]
    assert features.offset_per_key() == [0, 5, 5, 8]
    assert features.offset_per_key() == features.key_offsets().tolist()
    assert SparseFeatures([], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                          batch_size=3).offset_per_key() == [0]


@pytest.mark.parametrize("data", [EXAMPLE, SKEWED])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_offset_and_length_per_key_match_torchrec(data, device):
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cpu = SparseFeatures.from_dict(data)
    kjt = KeyedJaggedTensor(keys=cpu.keys, values=cpu.values.to(device), lengths=cpu.lengths.to(device))
    ours = SparseFeatures.from_kjt(kjt)  # KJT input, as a collection converts it
    # on meta there are no ids to count: both split N evenly over the keys, the remainder to the first
    assert ours.length_per_key() == kjt.length_per_key()
    assert ours.offset_per_key() == kjt.offset_per_key()
    assert cpu.to(device).offset_per_key() == kjt.offset_per_key()


def test_meta_batches_are_checked_for_their_features_only():
    tables = {"user_id": 2, "item_id": 2}  # every id of EXAMPLE is out of range
    cpu = SparseFeatures.from_dict(EXAMPLE)
    assert "outside the valid range" in cpu.validation_error(tables)
    meta = cpu.to("meta")
    assert meta.validation_error(tables) is None  # no ids to read
    assert "unknown feature(s) ['item_id']" in meta.validation_error({"user_id": 10})
    assert "missing expected feature(s)" in meta.validation_error({**tables, "genre": 3})


@pytest.mark.parametrize("source", ["cpu", "meta"])
def test_collection_forward_on_meta_gives_shapes(source):
    features = SparseFeatures.from_dict(EXAMPLE).to(source)
    bags = EmbeddingBagCollection(_tables(), device="meta")
    pooled = bags(features)
    assert pooled.values().device.type == "meta" and pooled.values().shape == (3, 12)
    assert pooled["item_id"].shape == (3, 8)
    sequences = EmbeddingCollection(_tables("none"), device="meta")(features)
    assert all(out.values.device.type == "meta" for out in sequences.values())
    assert sequences["user_id"].values.shape[1] == 4 and sequences["item_id"].values.shape[1] == 8
    if source == "cpu":  # real ids: their counts, not a guess
        assert [sequences[k].values.shape[0] for k in ("user_id", "item_id")] == [3, 2]


def test_meta_forward_matches_torchrec():
    pytest.importorskip("torchrec")
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecBags

    meta = torch.device("meta")
    theirs = TorchRecBags([EmbeddingBagConfig(name="user", num_embeddings=10, embedding_dim=4, feature_names=["user_id"]),
                           EmbeddingBagConfig(name="item", num_embeddings=6, embedding_dim=8, feature_names=["item_id"],
                                              pooling=PoolingType.MEAN)], device=meta)
    kjt = SparseFeatures.from_dict(EXAMPLE).to_kjt()
    expected = theirs(kjt)
    got = EmbeddingBagCollection(_tables(), device=meta)(kjt)
    assert got.values().shape == expected.values().shape and got.values().device == expected.values().device
    assert got.keys() == expected.keys() and got.length_per_key() == expected.length_per_key()


def test_collection_device_follows_its_tables():
    bags = EmbeddingBagCollection(_tables())
    assert bags.device == torch.device("cpu")
    assert EmbeddingBagCollection(_tables(), device="meta").device == torch.device("meta")
    assert EmbeddingCollection(_tables("none"), device="meta").device == torch.device("meta")
    assert bags.to("meta").device == torch.device("meta")


def test_collection_device_matches_torchrec():
    pytest.importorskip("torchrec")
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecBags

    config = [EmbeddingBagConfig(name="user", num_embeddings=10, embedding_dim=4, feature_names=["user_id"])]
    for device in (None, torch.device("cpu"), torch.device("meta")):
        assert EmbeddingBagCollection(_tables(), device=device).device == TorchRecBags(config, device=device).device
