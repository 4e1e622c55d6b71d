import sys

import pytest
import torch

from lightning_twod.core.features import JaggedIds, SparseFeatures


def _t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype)


# The docstring example: 2 features, batch of 3.
#              sample 0   sample 1   sample 2
# user_id      [1]        [2, 3]     []
# item_id      [4]        []         [5]
EXAMPLE = {"user_id": [[1], [2, 3], []], "item_id": [[4], [], [5]]}


@pytest.fixture
def sf():
    return SparseFeatures.from_dict(EXAMPLE)


@pytest.fixture
def weighted():
    return SparseFeatures.from_dict(
        {"a": [[1, 2], [], [3]], "b": [[4], [5, 6], []], "c": [[], [7], [8, 9]]},
        weights={"a": [[0.5, 1.5], [], [2.5]], "c": [[], [3.0], [4.0, 5.0]]},
    )


def _naive_split(d, sizes):
    out, start = [], 0
    for s in sizes:
        out.append({k: bags[start : start + s] for k, bags in d.items()})
        start += s
    return out


# ----------------------------------------------------------------- layout


def test_from_dict_layout(sf):
    assert sf.keys == ["user_id", "item_id"]
    assert torch.equal(sf.values, _t([1, 2, 3, 4, 5]))
    assert torch.equal(sf.lengths, _t([1, 2, 0, 1, 0, 1]))
    assert sf.values.dtype == torch.int64 and sf.lengths.dtype == torch.int64
    assert sf.weights is None
    assert sf.batch_size == 3
    assert sf.num_features == 2
    assert sf.num_values == 5
    assert sf.device == torch.device("cpu")
    assert torch.equal(sf.lengths_2d(), _t([[1, 2, 0], [1, 0, 1]]))
    assert sf.length_per_key() == [3, 2]
    assert torch.equal(sf.offsets(), _t([0, 1, 3, 3, 4, 4, 5]))
    assert torch.equal(sf.key_offsets(), _t([0, 3, 5]))
    assert sf.to_dict() == EXAMPLE
    r = repr(sf)
    assert "user_id" in r and "batch_size=3" in r and "num_values=5" in r


def test_from_dict_mismatched_batch():
    with pytest.raises(ValueError, match=r"'item_id' has 2 samples but feature 'user_id' has 3"):
        SparseFeatures.from_dict({"user_id": [[1], [2], [3]], "item_id": [[4], [5]]})


def test_from_dict_weights_default_one(weighted):
    assert weighted.weights.dtype == torch.float32
    assert torch.equal(weighted.weights, _t([0.5, 1.5, 2.5, 1.0, 1.0, 1.0, 3.0, 4.0, 5.0], torch.float32))
    assert torch.equal(weighted.values, _t([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert torch.equal(weighted.lengths, _t([2, 0, 1, 1, 2, 0, 0, 1, 2]))


def test_from_dict_weights_errors():
    with pytest.raises(ValueError, match="unknown feature"):
        SparseFeatures.from_dict({"a": [[1]]}, weights={"z": [[1.0]]})
    with pytest.raises(ValueError, match="'a' sample 0 has 2 ids but 1 weights"):
        SparseFeatures.from_dict({"a": [[1, 2]]}, weights={"a": [[1.0]]})


def test_from_dict_empty_weights_mapping_gives_ones(sf):
    w = SparseFeatures.from_dict(EXAMPLE, weights={})
    assert torch.equal(w.weights, torch.ones(5))


def test_from_padded_different_lengths_and_1d():
    ids = {
        "a": _t([[1, 2, -1], [-1, -1, -1], [3, -1, -1]]),
        "b": _t([[4], [5], [-1]]),
        "c": _t([7, -1, 9], torch.int32),  # one id per sample
    }
    sf = SparseFeatures.from_padded(ids)
    assert sf.keys == ["a", "b", "c"]
    assert torch.equal(sf.values, _t([1, 2, 3, 4, 5, 7, 9]))
    assert torch.equal(sf.lengths, _t([2, 0, 1, 1, 1, 0, 1, 0, 1]))
    assert sf.weights is None
    assert sf.to_dict() == {"a": [[1, 2], [], [3]], "b": [[4], [5], []], "c": [[7], [], [9]]}


def test_from_padded_custom_padding_and_weights():
    ids = {"a": _t([[1, 0], [2, 3]]), "b": _t([[0, 4], [0, 0]])}
    w = {"a": torch.tensor([[0.1, 9.0], [0.2, 0.3]])}
    sf = SparseFeatures.from_padded(ids, padding_value=0, weights=w)
    assert torch.equal(sf.values, _t([1, 2, 3, 4]))
    assert torch.equal(sf.lengths, _t([1, 2, 1, 0]))
    assert torch.equal(sf.weights, torch.tensor([0.1, 0.2, 0.3, 1.0]))


def test_from_padded_errors():
    with pytest.raises(ValueError, match="'b' has 3 samples but feature 'a' has 2"):
        SparseFeatures.from_padded({"a": _t([[1], [2]]), "b": _t([[1], [2], [3]])})
    with pytest.raises(ValueError, match="integer"):
        SparseFeatures.from_padded({"a": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="shape"):
        SparseFeatures.from_padded({"a": _t([[1, 2]])}, weights={"a": torch.ones(1, 3)})


# ------------------------------------------------------------- constructor


def test_init_converts_int32():
    sf = SparseFeatures(["a"], _t([1, 2], torch.int32), _t([2, 0], torch.int32))
    assert sf.values.dtype == torch.int64 and sf.lengths.dtype == torch.int64
    assert sf.batch_size == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keys=["a", "b"], values=_t([1, 2]), lengths=_t([1, 1, 0])), "not a multiple"),
        (dict(keys=["a", "a"], values=_t([1, 2]), lengths=_t([1, 1])), "unique"),
        (dict(keys=["a"], values=_t([[1, 2]]), lengths=_t([2])), "values must be a 1-D"),
        (dict(keys=["a"], values=_t([1, 2]), lengths=_t([[2]])), "lengths must be a 1-D"),
        (dict(keys=["a"], values=torch.tensor([1.0, 2.0]), lengths=_t([2])), "values must be an integer"),
        (dict(keys=["a"], values=_t([1, 2]), lengths=torch.tensor([2.0])), "lengths must be an integer"),
        (dict(keys=["a"], values=_t([1, 2]), lengths=_t([2]), weights=torch.ones(3)), "weights must have the shape"),
        (dict(keys=["a"], values=_t([1, 2]), lengths=_t([2]), weights=_t([1, 1])), "floating"),
        (dict(keys=["a"], values=_t([1, 2]), lengths=_t([1, 1]), batch_size=3), "disagrees"),
        (dict(keys=[], values=_t([]), lengths=_t([])), "batch_size is required"),
    ],
)
def test_init_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseFeatures(**kwargs)


def test_init_no_content_checks():
    # Expensive content checks are left to validate().
    sf = SparseFeatures(["a"], _t([1, 2]), _t([-1, 5]))
    assert sf.batch_size == 2


def test_no_keys():
    sf = SparseFeatures([], _t([]), _t([]), batch_size=4)
    assert sf.batch_size == 4 and sf.num_features == 0
    assert sf.lengths_2d().shape == (0, 4)
    assert sf.key_offsets().tolist() == [0]
    parts = sf.split_batch([1, 3])
    assert [p.batch_size for p in parts] == [1, 3]
    assert SparseFeatures.concat_batches(parts).equal(sf)
    assert sf.validation_error({}) is None


# ---------------------------------------------------------------- getitem


def test_getitem_views(weighted):
    b = weighted["b"]
    assert isinstance(b, JaggedIds)
    assert torch.equal(b.values, _t([4, 5, 6]))
    assert torch.equal(b.lengths, _t([1, 2, 0]))
    assert torch.equal(b.weights, torch.ones(3))
    # views, not copies
    assert b.values.data_ptr() == weighted.values.data_ptr() + 3 * 8
    assert b.lengths.data_ptr() == weighted.lengths.data_ptr() + 3 * 8
    assert b.weights.data_ptr() == weighted.weights.data_ptr() + 3 * 4
    c = weighted["c"]
    assert torch.equal(c.values, _t([7, 8, 9])) and torch.equal(c.weights, torch.tensor([3.0, 4.0, 5.0]))
    assert "a" in weighted and "z" not in weighted
    with pytest.raises(KeyError, match="'z'"):
        weighted["z"]


def test_getitem_unweighted(sf):
    u = sf["user_id"]
    assert torch.equal(u.values, _t([1, 2, 3])) and torch.equal(u.lengths, _t([1, 2, 0])) and u.weights is None
    i = sf["item_id"]
    assert torch.equal(i.values, _t([4, 5])) and torch.equal(i.lengths, _t([1, 0, 1]))


def test_not_iterable(sf):
    with pytest.raises(TypeError):
        iter(sf)


# ---------------------------------------------------------------- permute


def test_permute_reorder(weighted):
    p = weighted.permute(["c", "a", "b"])
    assert p.keys == ["c", "a", "b"]
    assert torch.equal(p.values, _t([7, 8, 9, 1, 2, 3, 4, 5, 6]))
    assert torch.equal(p.lengths, _t([0, 1, 2, 2, 0, 1, 1, 2, 0]))
    assert torch.equal(p.weights, torch.tensor([3.0, 4.0, 5.0, 0.5, 1.5, 2.5, 1.0, 1.0, 1.0]))
    assert p.length_per_key() == [3, 3, 3]
    assert p.permute(["a", "b", "c"]).equal(weighted)


def test_permute_subset(sf):
    p = sf.permute(["item_id"])
    assert p.keys == ["item_id"]
    assert torch.equal(p.values, _t([4, 5]))
    assert torch.equal(p.lengths, _t([1, 0, 1]))
    assert p.batch_size == 3
    assert p.to_dict() == {"item_id": [[4], [], [5]]}
    empty = sf.permute([])
    assert empty.num_features == 0 and empty.batch_size == 3 and empty.num_values == 0


def test_permute_errors(sf):
    with pytest.raises(KeyError, match="nope"):
        sf.permute(["nope"])
    with pytest.raises(ValueError, match="unique"):
        sf.permute(["user_id", "user_id"])


# ---------------------------------------------------------- split / concat


def test_split_batch_exact(weighted):
    p0, p1 = weighted.split_batch([1, 2])
    assert p0.batch_size == 1 and p1.batch_size == 2
    assert p0.to_dict() == {"a": [[1, 2]], "b": [[4]], "c": [[]]}
    assert p1.to_dict() == {"a": [[], [3]], "b": [[5, 6], []], "c": [[7], [8, 9]]}
    assert torch.equal(p0.lengths, _t([2, 1, 0]))
    assert torch.equal(p1.values, _t([3, 5, 6, 7, 8, 9]))
    assert torch.equal(p0.weights, torch.tensor([0.5, 1.5, 1.0]))
    assert torch.equal(p1.weights, torch.tensor([2.5, 1.0, 1.0, 3.0, 4.0, 5.0]))
    assert p1.length_per_key() == [1, 2, 3]


@pytest.mark.parametrize("sizes", [[3], [0, 3], [1, 1, 1], [2, 0, 1], [0, 0, 3, 0], [1, 2]])
def test_split_concat_round_trip(weighted, sizes):
    parts = weighted.split_batch(sizes)
    expected = _naive_split(weighted.to_dict(), sizes)
    assert [p.to_dict() for p in parts] == expected
    for p in parts:
        assert p.weights is not None and p.weights.shape == p.values.shape
        assert p.validation_error({"a": 10, "b": 10, "c": 10}) is None
    assert SparseFeatures.concat_batches(parts).equal(weighted)


def test_split_concat_random_round_trip():
    g = torch.Generator().manual_seed(0)
    keys = ["f0", "f1", "f2", "f3"]
    b = 17
    lengths = torch.randint(0, 4, (len(keys) * b,), generator=g)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
    sf = SparseFeatures(keys, values, lengths, weights=torch.rand(values.shape, generator=g))
    sizes = [5, 0, 7, 4, 1]
    parts = sf.split_batch(sizes)
    assert [p.to_dict() for p in parts] == _naive_split(sf.to_dict(), sizes)
    assert SparseFeatures.concat_batches(parts).equal(sf)
    # concat of independently built batches equals the whole
    halves = [SparseFeatures.from_dict(d) for d in _naive_split(sf.to_dict(), [9, 8])]
    assert SparseFeatures.concat_batches(halves).to_dict() == sf.to_dict()


def test_split_zero_size_slice_shape(sf):
    empty, full = sf.split_batch([0, 3])
    assert empty.batch_size == 0 and empty.lengths.shape == (0,) and empty.values.shape == (0,)
    assert empty.keys == sf.keys and empty.to_dict() == {"user_id": [], "item_id": []}
    assert full.equal(sf)


def test_split_errors(sf):
    with pytest.raises(ValueError, match="sum to 2"):
        sf.split_batch([1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        sf.split_batch([4, -1])


def test_concat_errors(sf, weighted):
    with pytest.raises(ValueError, match="keys must match"):
        SparseFeatures.concat_batches([sf, sf.permute(["item_id", "user_id"])])
    w = SparseFeatures.from_dict(EXAMPLE, weights={})
    with pytest.raises(ValueError, match="all parts or none"):
        SparseFeatures.concat_batches([sf, w])
    with pytest.raises(ValueError, match="at least one"):
        SparseFeatures.concat_batches([])


# ------------------------------------------------------------ device moves


def test_to_cpu_and_lightning_move(weighted):
    moved = weighted.to("cpu")
    assert isinstance(moved, SparseFeatures) and moved.equal(weighted)
    moved = weighted.to(torch.device("cpu"), non_blocking=True)
    assert moved.equal(weighted)

    from lightning.fabric.utilities.apply_func import move_data_to_device

    batch = {"sparse": weighted, "dense": torch.ones(3, 2), "label": [torch.zeros(3)]}
    out = move_data_to_device(batch, torch.device("cpu"))
    assert isinstance(out["sparse"], SparseFeatures)
    assert out["sparse"].equal(weighted)

    from lightning.pytorch.utilities import move_data_to_device as pl_move

    out2 = pl_move((weighted, torch.ones(1)), "cpu")
    assert isinstance(out2[0], SparseFeatures) and out2[0].equal(weighted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory")
def test_pin_memory_and_cuda(weighted):
    pinned = weighted.pin_memory()
    assert pinned.values.is_pinned() and pinned.weights.is_pinned()
    dev = pinned.to("cuda", non_blocking=True)
    assert dev.device.type == "cuda"
    assert dev.validation_error({"a": 10, "b": 10, "c": 10}) is None
    assert dev.split_batch([1, 2])[1].to("cpu").equal(weighted.split_batch([1, 2])[1])


# -------------------------------------------------------------- validation

NUM = {"user_id": 10, "item_id": 6}
TABLES = {"user_id": "t_user", "item_id": "t_item"}


def test_validate_ok(sf):
    assert sf.validation_error(NUM) is None
    assert sf.validation_error(NUM, TABLES) is None
    sf.validate(NUM, table_of=TABLES)


def test_validate_unknown_key(sf):
    msg = sf.validation_error({"user_id": 10})
    assert msg is not None and "'item_id'" in msg and "unknown" in msg and "expected features: ['user_id']" in msg
    with pytest.raises(ValueError, match="item_id"):
        sf.validate({"user_id": 10})


def test_validate_missing_key(sf):
    msg = sf.validation_error({**NUM, "geo": 3}, table_of={"geo": "t_geo"})
    assert "missing" in msg and "'geo'" in msg and "'t_geo'" in msg
    with pytest.raises(ValueError, match="missing expected feature.*'geo'"):
        sf.validate({**NUM, "geo": 3})


def test_validate_negative_length():
    sf = SparseFeatures(["user_id", "item_id"], _t([1, 2, 3]), _t([1, 1, 0, 2, -1, 0]))
    msg = sf.validation_error(NUM, TABLES)
    assert "'item_id'" in msg and "'t_item'" in msg and "negative length -1" in msg and "sample 1" in msg
    with pytest.raises(ValueError, match="negative length -1 at sample 1"):
        sf.validate(NUM)


def test_validate_sum_mismatch():
    sf = SparseFeatures(["user_id", "item_id"], _t([1, 2, 3, 4]), _t([1, 2, 0, 1, 0, 1]))
    msg = sf.validation_error(NUM)
    assert "sum to 5" in msg and "N=4" in msg
    with pytest.raises(ValueError, match="lengths sum to 5 but there are N=4 values"):
        sf.validate(NUM)


def test_validate_id_too_large(sf):
    # item ids are [4] [] [5]; table of 5 rows -> id 5 at sample 2 is out of range
    num = {"user_id": 10, "item_id": 5}
    msg = sf.validation_error(num, TABLES)
    assert "'item_id'" in msg and "'t_item'" in msg
    assert "id 5" in msg and "sample 2" in msg and "[0, 5)" in msg
    assert "more" not in msg
    with pytest.raises(ValueError, match=r"feature 'item_id' has id 5 at sample 2, outside the valid range \[0, 5\)"):
        sf.validate(num)


def test_validate_negative_id_and_count():
    sf = SparseFeatures.from_dict({"user_id": [[0], [], [3, -2]], "item_id": [[7], [9], []]})
    msg = sf.validation_error(NUM, TABLES)
    assert "'user_id'" in msg and "'t_user'" in msg and "id -2" in msg and "sample 2" in msg and "[0, 10)" in msg
    assert "2 more out-of-range" in msg  # item ids 7 and 9 >= 6


def test_validate_first_bad_after_empty_bags():
    sf = SparseFeatures.from_dict({"a": [[], [], [1]], "b": [[], [], []]})
    msg = sf.validation_error({"a": 1, "b": 1})
    assert "feature 'a' has id 1 at sample 2" in msg


def test_validate_each_feature_against_its_own_table():
    """An id that is valid for one feature's table is caught in another feature with fewer rows,
    also after a feature without any ids."""
    rows = {"a": 100, "b": 3, "c": 50}
    ok = SparseFeatures.from_dict({"a": [[99], [0, 98]], "b": [[], []], "c": [[49], []]})
    assert ok.validation_error(rows) is None
    bad = SparseFeatures.from_dict({"a": [[99], [0, 98]], "b": [[], []], "c": [[49], [0, 60]]})
    assert "feature 'c' has id 60 at sample 1, outside the valid range [0, 50)" in bad.validation_error(rows)
    negative = SparseFeatures.from_dict({"a": [[99], [0, 98]], "b": [[], [-1]], "c": [[49], []]})
    assert "feature 'b' has id -1 at sample 1" in negative.validation_error(rows)


def test_validate_ragged_ids_inside_every_table_build_no_bound_per_id(monkeypatch):
    """A valid batch of bags of different sizes is settled by its smallest and largest id (read with the
    lengths): no bound per id is built; an id past its own, smaller table still names its feature."""
    rows = {"a": 100, "b": 3, "c": 50}
    ok = SparseFeatures.from_dict({"a": [[2], [0, 1, 2]], "b": [[], [1]], "c": [[0], [2, 1]]})
    bad = SparseFeatures.from_dict({"a": [[2], [0, 1, 2]], "b": [[], [4]], "c": [[0], [2, 1]]})
    repeat_interleave = torch.repeat_interleave

    def no_bound_per_id(*args, **kwargs):
        raise AssertionError("a bound per id was built for a batch whose ids all fit the smallest table")

    monkeypatch.setattr(torch, "repeat_interleave", no_bound_per_id)
    assert ok.validation_error(rows) is None
    monkeypatch.setattr(torch, "repeat_interleave", repeat_interleave)
    assert "feature 'b' has id 4 at sample 1, outside the valid range [0, 3)" in bad.validation_error(rows)


def test_validate_ids_without_bags():
    sf = SparseFeatures(["a", "b"], torch.tensor([1, 2]), torch.zeros(0, dtype=torch.int64))
    assert sf.batch_size == 0
    msg = sf.validation_error({"a": 5, "b": 5})
    assert "feature 'b': lengths sum to 0 but there are N=2 values" in msg


def test_validate_ids_without_features():
    sf = SparseFeatures([], torch.tensor([1, 2]), torch.zeros(0, dtype=torch.int64), batch_size=3)
    assert "there are N=2 values but no features" in sf.validation_error({})


def test_validate_empty_batch():
    sf = SparseFeatures.from_dict({"a": [], "b": []})
    assert sf.batch_size == 0
    assert sf.validation_error({"a": 1, "b": 1}) is None


# ---------------------------------------------------------------- TorchRec


class FakeKJT:
    def __init__(self, keys, values, lengths, weights=None):
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return self._weights


def test_from_kjt_duck_typed():
    kjt = FakeKJT(
        ["user_id", "item_id"], _t([1, 2, 3, 4, 5]), _t([1, 2, 0, 1, 0, 1], torch.int32), torch.arange(5.0)
    )
    sf = SparseFeatures.from_kjt(kjt)
    assert sf.keys == ["user_id", "item_id"]
    assert sf.lengths.dtype == torch.int64
    assert sf.to_dict() == EXAMPLE
    assert torch.equal(sf.weights, torch.arange(5.0))
    assert sf.values is kjt.values()  # shares the int64 tensor
    with pytest.raises(ValueError, match="not a multiple"):
        SparseFeatures.from_kjt(FakeKJT(["a", "b"], _t([1]), _t([1])))


def test_to_kjt_without_torchrec(sf, monkeypatch):
    # torchrec (and any of its modules already imported) made unimportable, as on a machine without it
    for name in [m for m in sys.modules if m == "torchrec" or m.startswith("torchrec.")] + ["torchrec"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install torchrec"):
        sf.to_kjt()


def test_kjt_round_trip_torchrec(weighted):
    pytest.importorskip("torchrec")
    kjt = weighted.to_kjt()
    assert list(kjt.keys()) == weighted.keys
    assert torch.equal(kjt.values(), weighted.values)
    assert torch.equal(kjt.lengths(), weighted.lengths)
    assert SparseFeatures.from_kjt(kjt).equal(weighted)
