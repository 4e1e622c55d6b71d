"""Bad sparse input: a ValueError naming the feature (and table) and the offending value.

Sharded (2x2 and 1x4 gloo meshes): only rank 1 gets the bad batch, yet every rank raises the same
error before any id is sent (the byte counter stays at zero: the verdicts ride in the header
exchange, which counts only once ids follow), no shard weight or gradient changes, and all ranks then
run a good training step together (nobody is stuck in a collective). On 1x4 the shard group is the
world and the header carries the verdict alone; on 2x2 a world flag tells the other group.
Unsharded (one process): the collections raise the same errors and leave their weights alone.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.distributed import run_distributed
from tests.helpers.sparse_cases import POOLED_TABLES, constraints, make_module, random_batch

from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.core.features import SparseFeatures
from lightning_twod.sparse.sharded import shard_collection
from lightning_twod.core.shards import place_tables
from lightning_twod.distributed import MeshGroups, SparseParallelDims

BATCH_SEED = 7
BATCH_SIZES = [3, 3, 2, 3]


def _block(features: SparseFeatures, key: str) -> tuple[int, int]:
    """``(start, end)`` of ``key``'s ids in ``features.values``."""
    i = features.keys.index(key)
    lpk = features.length_per_key()
    return sum(lpk[:i]), sum(lpk[:i + 1])


def _bad_batch(good: SparseFeatures, kind: str) -> tuple[SparseFeatures, list[str]]:
    """A corrupted copy of ``good`` and the strings its error message must contain.

    Built with the plain constructor (which checks only shapes), so the content checks of the
    collections are what must catch it.
    """
    keys = good.keys
    values, lengths = good.values.clone(), good.lengths.clone()
    weights = good.weights.clone() if good.weights is not None else None
    b = good.batch_size
    if kind in ("id_too_large", "id_negative"):
        # f_rw_shared reads table t_rw (53 rows): the message must name both feature and table
        start, end = _block(good, "f_rw_shared")
        assert end > start, "test batch needs an id of f_rw_shared on rank 1"
        bad = 53 + 1000 if kind == "id_too_large" else -3
        values[end - 1] = bad
        return SparseFeatures(keys, values, lengths, weights), [
            "'f_rw_shared'", "'t_rw'", f"id {bad}", "[0, 53)"]
    if kind == "negative_length":
        # bag 0 of f_tw gets length -2; its ids move to bag 1, so lengths still sum to N
        i = keys.index("f_tw") * b
        lengths[i + 1] += lengths[i] + 2
        lengths[i] = -2
        assert int(lengths.sum()) == values.numel()
        return SparseFeatures(keys, values, lengths, weights), ["'f_tw'", "'t_tw'", "negative length -2"]
    if kind == "lengths_sum":
        # one more id claimed by bag 0 of f_dp than the values hold: the ids of the last
        # feature (f_tw2) now end past N, and the message names it
        lengths[keys.index("f_dp") * b] += 1
        total = int(lengths.sum())
        assert keys[-1] == "f_tw2"
        return SparseFeatures(keys, values, lengths, weights), [
            "'f_tw2'", f"sum to {total}", f"N={values.numel()}"]
    if kind == "unknown_key":
        extra = torch.tensor([1] + [0] * (b - 1))
        values = torch.cat([values, torch.tensor([0])])
        weights = torch.cat([weights, torch.ones(1)]) if weights is not None else None
        return SparseFeatures(keys + ["f_bogus"], values, torch.cat([lengths, extra]), weights), ["'f_bogus'"]
    if kind == "missing_key":
        i = keys.index("f_cw")
        start, end = _block(good, "f_cw")
        keep = torch.cat([torch.arange(start), torch.arange(end, values.numel())])
        lengths = torch.cat([lengths[:i * b], lengths[(i + 1) * b:]])
        weights = weights[keep] if weights is not None else None
        return SparseFeatures(keys[:i] + keys[i + 1:], values[keep], lengths, weights), ["'f_cw'", "'t_cw'"]
    raise AssertionError(kind)


KINDS = ["id_too_large", "id_negative", "negative_length", "lengths_sum", "unknown_key", "missing_key"]


def _plan(group_size: int):
    return place_tables([(n, r, d) for n, r, d, *_ in POOLED_TABLES], group_size, constraints())


def _loss(out, pooled: bool):
    if pooled:
        return out.values().pow(2).sum()
    return sum(j.values.pow(2).sum() for j in out.values())


def _bad_input_worker(rank, world, group_size):
    groups = MeshGroups.create(SparseParallelDims(world, group_size))
    good = random_batch(sum(BATCH_SIZES), seed=BATCH_SEED).split_batch(BATCH_SIZES)[rank]
    report = {}
    for pooled in (True, False):
        reference = make_module(pooled, seed=3)
        counter = ByteCounter(rank, world)
        sharded = shard_collection(reference, groups, plan=_plan(group_size), backend="torch", counter=counter,
                                   optimizer=SparseOptimizerConfig("sgd", lr=0.5))
        before = [(str(shard), w.clone()) for shard, w in sharded.local_shards()]
        messages = {}
        for kind in KINDS:
            batch, expected = _bad_batch(good, kind) if rank == 1 else (good, [])
            try:
                sharded(batch)
            except ValueError as err:
                messages[kind] = str(err)
            else:
                raise AssertionError(f"rank {rank}: no ValueError for {kind} (pooled={pooled})")
            for needle in expected:  # the bad rank's own message, before the gather
                assert needle in messages[kind], f"{kind}: {needle!r} not in {messages[kind]!r}"
        # nothing was sent, looked up or updated while the batches were bad
        assert counter.total() == 0, f"rank {rank} sent {counter.by_name()} before the check failed"
        for (name, old), (_, new) in zip(before, sharded.local_shards(), strict=True):
            assert torch.equal(old, new), f"rank {rank}: shard {name} changed during the failing calls"
        for kernel in sharded.kernels():
            assert all(p.grad is None for p in kernel.shard_weights)

        # every rank can still run one good step together
        out = sharded(good)
        expected_out = reference(good)
        if pooled:
            torch.testing.assert_close(out.values(), expected_out.values(), atol=1e-5, rtol=0)
        else:
            for feature in expected_out:
                torch.testing.assert_close(out[feature].values, expected_out[feature].values, atol=1e-5, rtol=0)
        _loss(out, pooled).backward()
        for kernel in sharded.kernels():
            kernel.step()
        changed = [name for (name, old), (_, new) in zip(before, sharded.local_shards(), strict=True)
                   if not torch.equal(old, new)]
        assert counter.total() > 0
        report[pooled] = (messages, changed)
    return report


@pytest.mark.parametrize("group_size", [2, 4], ids=["2x2", "1x4"])
def test_bad_input_on_one_rank_raises_on_every_rank(group_size):
    reports = run_distributed(_bad_input_worker, 4, group_size, timeout=120)
    for pooled in (True, False):
        for kind in KINDS:
            per_rank = [r[pooled][0][kind] for r in reports]
            assert len(set(per_rank)) == 1, f"{kind}: ranks raised different messages {per_rank}"
            message = per_rank[0]
            assert "rank 1" in message and "rank 0" not in message, message
        # the good step after the failures updated rows on every rank
        assert all(r[pooled][1] for r in reports), [r[pooled][1] for r in reports]


# ---------------------------------------------------------------- one process, unsharded
def _good_batch() -> SparseFeatures:
    return random_batch(sum(BATCH_SIZES), seed=BATCH_SEED).split_batch(BATCH_SIZES)[1]


@pytest.mark.parametrize("pooled", [True, False], ids=["bag", "sequence"])
@pytest.mark.parametrize("kind", KINDS)
def test_unsharded_collection_rejects_bad_input(kind, pooled):
    module = make_module(pooled, seed=1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    bad, expected = _bad_batch(_good_batch(), kind)
    with pytest.raises(ValueError) as info:
        module(bad)
    for needle in expected:
        assert needle in str(info.value)
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_single_process_sharded_rejects_bad_input(kind):
    sharded = shard_collection(make_module(True, seed=1), MeshGroups.single_process(), backend="torch")
    before = [w.clone() for _, w in sharded.local_shards()]
    bad, expected = _bad_batch(_good_batch(), kind)
    with pytest.raises(ValueError) as info:
        sharded(bad)
    for needle in expected:
        assert needle in str(info.value)
    for old, (_, new) in zip(before, sharded.local_shards(), strict=True):
        assert torch.equal(old, new)


def test_validate_inputs_false_skips_the_check(monkeypatch):
    calls = []
    original = SparseFeatures.validation_error

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SparseFeatures, "validation_error", counting)
    batch = _good_batch()
    for pooled in (True, False):
        module = make_module(pooled, seed=2)
        sharded = shard_collection(module, MeshGroups.single_process(), backend="torch")
        expected = module(batch)
        assert len(calls) == 1  # the unsharded module checks by default
        sharded(batch)
        assert len(calls) == 2  # and so does the sharded one
        module.validate_inputs = False
        sharded.validate_inputs = False
        out, unchecked = sharded(batch), module(batch)
        assert len(calls) == 2, "validate_inputs=False must skip the input check"
        if pooled:
            torch.testing.assert_close(out.values(), expected.values(), atol=1e-6, rtol=0)
            torch.testing.assert_close(unchecked.values(), expected.values(), atol=0, rtol=0)
        else:
            for feature in expected:
                torch.testing.assert_close(out[feature].values, expected[feature].values, atol=1e-6, rtol=0)
        calls.clear()
