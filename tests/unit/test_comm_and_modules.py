"""Collectives' byte accounting and the unsharded collections, on one process (the all-to-all on 4
processes: ``tests/system/test_comm_and_modules.py``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_twod.core.features import SparseFeatures
from lightning_twod.core.outputs import JaggedEmbeddings, PooledEmbeddings
from lightning_twod.distributed.comm import ByteCounter, all_to_all
from lightning_twod.sparse.modules import EmbeddingBagCollection, EmbeddingCollection, EmbeddingTableConfig

# ---------------------------------------------------------------- (a) byte counter


def test_byte_counter_arithmetic():
    counter = ByteCounter(rank=1, world_size=4)
    counter.add("a", [0, 1, 2, 3], [10, 20, 30, 40])  # 20 bytes to itself: not counted
    counter.add("a", [2], [5])
    counter.add("b", [0, 1], [7, 100])
    assert counter.sent["a"] == [10, 0, 35, 40]
    assert counter.total() == 10 + 35 + 40 + 7
    assert counter.total(peers=[2]) == 35
    assert counter.total(peers=[1]) == 0
    assert counter.total(peers=[0, 3], names=["a"]) == 50
    assert counter.total(names=["b"]) == 7
    assert counter.total(names=["b", "never"]) == 7
    assert counter.by_name() == {"a": 85, "b": 7}
    with pytest.raises(ValueError):  # peers and sizes must pair up
        counter.add("a", [0, 2], [1])
    counter.reset()
    assert counter.total() == 0 and counter.by_name() == {}


def test_all_to_all_without_process_group():
    x = torch.arange(6.0).view(3, 2).requires_grad_()
    counter = ByteCounter(0, 1)
    out = all_to_all(x, [3], [3], None, grad_scale=0.25, counter=counter, peers=[0])
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    out.backward(torch.ones(3, 2))
    assert torch.equal(x.grad, torch.full((3, 2), 0.25))
    assert counter.total() == 0  # a rank's bytes to itself cross no link


# ---------------------------------------------------------------- (c) unsharded modules


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"num_embeddings": 0}, "num_embeddings must be a positive int, got 0"),
        ({"num_embeddings": 5.0}, "num_embeddings must be a positive int, got 5.0"),
        ({"num_embeddings": True}, "num_embeddings must be a positive int, got True"),
        ({"embedding_dim": -2}, "embedding_dim must be a positive int, got -2"),
        ({"pooling": "max"}, "pooling='max'"),
        ({"init": "xavier"}, "init='xavier'"),
        ({"feature_names": ["f", "g", "f"]}, "feature_names repeat"),
        ({"name": ""}, "non-empty name"),
    ],
)
def test_table_config_validation(kwargs, needle):
    args = {"name": "t", "num_embeddings": 5, "embedding_dim": 4, **kwargs}
    with pytest.raises(ValueError) as info:
        EmbeddingTableConfig(**args)
    assert needle in str(info.value)
    if args["name"]:
        assert "'t'" in str(info.value)


def test_table_config_defaults():
    table = EmbeddingTableConfig("user", 10, 4)
    assert table.feature_names == ["user"] and table.pooling == "sum" and table.init == "uniform"


def test_collection_validation():
    a = EmbeddingTableConfig("a", 4, 2, ["x"])
    with pytest.raises(ValueError, match=r"table names repeat: \['a', 'a'\]"):
        EmbeddingBagCollection([a, EmbeddingTableConfig("a", 3, 2, ["y"])])
    with pytest.raises(ValueError, match="feature 'x' is listed by tables 'a' and 'b'"):
        EmbeddingBagCollection([a, EmbeddingTableConfig("b", 3, 2, ["y", "x"])])
    with pytest.raises(ValueError, match="table 'c' has pooling='none'.*EmbeddingCollection"):
        EmbeddingBagCollection([a, EmbeddingTableConfig("c", 3, 2, ["z"], pooling="none")])
    with pytest.raises(ValueError, match="table 'a' has pooling='sum'.*EmbeddingBagCollection"):
        EmbeddingCollection([a])
    with pytest.raises(ValueError, match="at least one"):
        EmbeddingCollection([])


A_WEIGHT = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
B_WEIGHT = torch.arange(9.0).view(3, 3)


def _tables(pooled: bool):
    return [
        EmbeddingTableConfig("a", 4, 2, ["x", "y"], "sum" if pooled else "none"),  # shared by two features
        EmbeddingTableConfig("b", 3, 3, ["z"], "mean" if pooled else "none"),
    ]


def _example_batch() -> SparseFeatures:
    #           sample 0   sample 1   sample 2
    # x         [0, 1]     []         [3]         weights [1, 2] [] [0.5]
    # y         [2]        [2, 2]     []          (weights 1)
    # z         [0, 1, 2]  []         [1]         weights [1, 1, 2] [] [3]
    return SparseFeatures.from_dict(
        {"x": [[0, 1], [], [3]], "y": [[2], [2, 2], []], "z": [[0, 1, 2], [], [1]]},
        weights={"x": [[1.0, 2.0], [], [0.5]], "z": [[1.0, 1.0, 2.0], [], [3.0]]},
    )


def _loaded(cls, pooled: bool):
    module = cls(_tables(pooled))
    prefix = "embedding_bags" if pooled else "embeddings"
    module.load_state_dict({f"{prefix}.a.weight": A_WEIGHT, f"{prefix}.b.weight": B_WEIGHT})
    return module


def test_embedding_bag_collection_forward_by_hand():
    out = _loaded(EmbeddingBagCollection, True)(_example_batch())
    assert isinstance(out, PooledEmbeddings)
    assert out.keys() == ["x", "y", "z"] and out.dims == [2, 2, 3] and out.values().shape == (3, 7)
    # x: 1*[1,2] + 2*[3,4];  nothing;  0.5*[7,8]
    assert out["x"].tolist() == [[7.0, 10.0], [0.0, 0.0], [3.5, 4.0]]
    # y reads the same table a: row 2; row 2 twice; nothing
    assert out["y"].tolist() == [[5.0, 6.0], [10.0, 12.0], [0.0, 0.0]]
    # z, mean = weighted sum / number of ids: ([0,1,2] + [3,4,5] + 2*[6,7,8]) / 3; empty -> 0; 3*[3,4,5] / 1
    expected_z = torch.tensor([[15.0 / 3, 19.0 / 3, 23.0 / 3], [0.0, 0.0, 0.0], [9.0, 12.0, 15.0]])
    torch.testing.assert_close(out["z"], expected_z, atol=1e-6, rtol=0)


def test_pooled_views_share_storage():
    out = _loaded(EmbeddingBagCollection, True)(_example_batch())
    values = out.values()
    y = out["y"]
    assert y.data_ptr() == values[:, 2:4].data_ptr()
    assert y.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
    assert y.stride() == values.stride()  # a view into the [B, 7] buffer, not a compact copy
    with torch.no_grad():
        values[1, 2] = -1.0
    assert out["y"][1, 0] == -1.0
    assert list(out.to_dict()) == ["x", "y", "z"] and len(out) == 3 and list(out) == ["x", "y", "z"]
    with pytest.raises(ValueError, match=r"values must be \[B, 5\]"):
        PooledEmbeddings(["p", "q"], [2, 3], torch.zeros(4, 6))


def test_pooled_values_from_a_function_are_read_once_and_split_by_one_node():
    calls = []
    values = torch.arange(12.0).view(2, 6).requires_grad_()

    def arrive():
        calls.append(1)
        return values * 1.0

    out = PooledEmbeddings(["p", "q", "r"], [1, 2, 3], arrive, batch_size=2)
    assert calls == [] and "batch=2" in repr(out)  # nothing waited for yet
    features = [out[k] for k in out]
    assert calls == [1] and out.values() is out.values() and len(calls) == 1
    assert {f.grad_fn for f in features} == {features[0].grad_fn}  # one split, not a slice per feature
    torch.stack([f.sum(1) for f in features]).sum().backward()
    assert torch.equal(values.grad, torch.ones(2, 6))
    with pytest.raises(ValueError, match="batch_size"):
        PooledEmbeddings(["p"], [1], arrive)

    # read first under no_grad (a log line), then used in the loss: the graph of the lookup's mode is kept
    values.grad = None
    late = PooledEmbeddings(["p", "q", "r"], [1, 2, 3], arrive, batch_size=2)
    with torch.no_grad():
        assert late["q"].shape == (2, 2)
    late["r"].sum().backward()
    assert torch.equal(values.grad, torch.tensor([[0.0, 0, 0, 1, 1, 1]] * 2))
    unread = PooledEmbeddings(["p", "q", "r"], [1, 2, 3], lambda: values.detach().clone(), batch_size=2)
    copied = copy.deepcopy(unread)  # copied as read, not as the function that waits
    assert copied._pending is None and torch.equal(copied.values(), values.detach())
    with pytest.raises(ValueError, match=r"values must be \[B, 6\]"):
        PooledEmbeddings(["p", "q", "r"], [1, 2, 3], lambda: torch.zeros(2, 5), batch_size=2).values()


def test_embedding_collection_forward_by_hand_and_padding():
    out = _loaded(EmbeddingCollection, False)(_example_batch())
    assert set(out) == {"x", "y", "z"} and all(isinstance(j, JaggedEmbeddings) for j in out.values())
    assert out["x"].values.tolist() == [[1.0, 2.0], [6.0, 8.0], [3.5, 4.0]]  # per-id weights scale rows
    assert out["x"].lengths.tolist() == [2, 0, 1]
    assert out["y"].values.tolist() == [[5.0, 6.0], [5.0, 6.0], [5.0, 6.0]]
    assert out["z"].values.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [12.0, 14.0, 16.0], [9.0, 12.0, 15.0]]
    padded = out["x"].to_padded()
    assert padded.tolist() == [[[1.0, 2.0], [6.0, 8.0]], [[0.0, 0.0], [0.0, 0.0]], [[3.5, 4.0], [0.0, 0.0]]]
    padded = out["z"].to_padded(max_length=2, padding_value=-1.0)  # truncates sample 0's third row
    assert padded.tolist() == [
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [[-1.0] * 3, [-1.0] * 3], [[9.0, 12.0, 15.0], [-1.0] * 3],
    ]
    assert out["x"].offsets().tolist() == [0, 2, 2, 3]


@pytest.mark.parametrize("pooled", [True, False], ids=["bag", "sequence"])
def test_state_dict_keys_shapes_and_round_trip(pooled):
    cls, prefix = (EmbeddingBagCollection, "embedding_bags") if pooled else (EmbeddingCollection, "embeddings")
    torch.manual_seed(0)
    first = cls(_tables(pooled))
    state = first.state_dict()
    assert list(state) == [f"{prefix}.a.weight", f"{prefix}.b.weight"]
    assert state[f"{prefix}.a.weight"].shape == (4, 2) and state[f"{prefix}.b.weight"].shape == (3, 3)
    torch.manual_seed(1)
    second = cls(_tables(pooled))
    assert not torch.equal(second.state_dict()[f"{prefix}.a.weight"], state[f"{prefix}.a.weight"])
    second.load_state_dict(state)
    for key, value in second.state_dict().items():
        assert torch.equal(value, state[key])
    a, b = first(_example_batch()), second(_example_batch())
    if pooled:
        assert torch.equal(a.values(), b.values())
    else:
        assert all(torch.equal(a[f].values, b[f].values) for f in a)
    with pytest.raises(RuntimeError):  # a wrong shape is refused
        second.load_state_dict({f"{prefix}.a.weight": torch.zeros(5, 2), f"{prefix}.b.weight": B_WEIGHT})


def test_init_options():
    torch.manual_seed(0)
    rows = 400
    module = EmbeddingBagCollection([
        EmbeddingTableConfig("u", rows, 32, ["u"]),
        EmbeddingTableConfig("n", 300, 64, ["n"], init="normal"),
        EmbeddingTableConfig("z", 7, 4, ["z"], init="zeros"),
        EmbeddingTableConfig("c", 5, 4, ["c"], init=lambda w: w.fill_(0.5)),
    ])
    u = module.embedding_bags["u"].weight.detach()
    bound = 1 / math.sqrt(rows)
    assert u.abs().max() <= bound and u.abs().max() > 0.95 * bound  # U(-1/sqrt(rows), 1/sqrt(rows))
    assert abs(float(u.mean())) < 0.05 * bound
    n = module.embedding_bags["n"].weight.detach()
    assert abs(float(n.std()) - 1 / math.sqrt(64)) < 0.01  # N(0, 1/sqrt(dim))
    assert not module.embedding_bags["z"].weight.any()
    assert torch.equal(module.embedding_bags["c"].weight, torch.full((5, 4), 0.5))
    assert all(p.requires_grad for p in module.parameters())
