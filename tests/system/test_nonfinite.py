"""Non-finite values (NaN or inf) on one copy stop every rank before they are averaged in.

A round of the cross-group reduction would spread a NaN or inf row of one copy to every copy
(fp32, bf16) or hide it (int8: the row's scale ignores it, its residual stays NaN). Each case below
injects NaN or inf into one copy's row (a row that copy touched, a row only the other copy touched,
a shard sent whole, the row-wise state) and asserts that every rank raises the same error naming
the table and the rank, and that no copy's weights or state changed. Real gloo processes: two
copies of one replica group, and a 2 x 2 mesh where the other replica group, and a rank holding no
replicated shard, must stop too. ``sync_mode="gradients"`` is checked the same way.
"""

from __future__ import annotations

import pytest
import torch

from lightning_twod.core.shards import Shard
from lightning_twod.replication import NonFiniteError, ReplicaReducer, ReplicatedKernel
from lightning_twod.replication.gradients import step_with_mean_gradients
from lightning_twod.sparse.kernels import ShardShape, TorchKernel, fbgemm_available
from tests.helpers.distributed import run_distributed
from tests.helpers.replication_cases import look_up, make_kernel

SHAPES = [ShardShape(40, 4), ShardShape(8, 2)]  # shard 1 is small: all its rows touched, it is sent whole
SHARDS = [Shard("big_table", 0, 40, 0, 4, 0), Shard("small_table", 0, 8, 0, 2, 0)]
# (shard, row, whether the row-wise state rather than the weights is spoiled) on the spoiled copy
# (copy 1 touched rows 2 and 5 of shard 0, copy 0 rows 1 and 2: a_step)
PLACES = {"own row": (0, 5, False), "the other copy's row": (0, 1, False), "whole shard": (1, 3, False),
          "state": (0, 2, True)}
BAD = {"nan": float("nan"), "inf": float("inf")}


def bits(kernel: TorchKernel) -> list[torch.Tensor]:
    """The copy's weights and state as integers: NaN compares equal to itself."""
    return [t.detach().clone().view(torch.int32) for t in (*kernel.weights(), *kernel.optimizer_states())]


def a_step(kernel: TorchKernel, copy: int) -> None:
    """Copy 0 changes shard 0's rows {1, 2}, copy 1 rows {2, 5}; both change all of shard 1."""
    rows = [[1, 2], list(range(8))] if copy == 0 else [[2, 5], list(range(8))]
    look_up(kernel, rows)
    with torch.no_grad():
        kernel.weights()[0][rows[0]] += 0.01 * (copy + 1)
        kernel.optimizer_states()[0][rows[0]] += 0.5
        kernel.weights()[1].sub_(0.003 * (copy + 1))


def spoil(kernel: TorchKernel, place: str, value: float) -> None:
    shard, row, state = PLACES[place]
    with torch.no_grad():
        if state:
            kernel.optimizer_states()[shard][row] = value
        else:
            kernel.weights()[shard][row, 1] = value


def a_round(reducer: ReplicaReducer, overlap: bool) -> str | None:
    """Run a round (blocking, or launched and applied); the error's message, if it raised."""
    try:
        if overlap:
            reducer.launch()
            reducer.finish()
        else:
            reducer.reduce()
    except NonFiniteError as err:
        return str(err)
    return None


def round_and_flush(reducer: ReplicaReducer, kernel: TorchKernel, overlap: bool, sync_dtype: str) -> dict:
    """A round (``a_round``); whether it left this copy unchanged; on int8, then a drain's flush of
    the residuals (as a state read after the error does): its error, and whether the copy is finite."""
    before = bits(kernel)
    error = a_round(reducer, overlap)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, bits(kernel), strict=True))
    flushed = None
    if sync_dtype == "int8":
        try:
            reducer.flush_residuals()
        except NonFiniteError as err:
            flushed = str(err)
    finite = all(bool(torch.isfinite(t).all()) for t in (*kernel.weights(), *kernel.optimizer_states()))
    return dict(error=error, unchanged=unchanged, flushed=flushed, finite=finite)


def _pair_worker(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    import torch.distributed as dist

    out = []
    for sync_dtype, overlap, place, bad in cases:
        kernel = make_kernel(SHAPES, [0, 1])
        reducer = ReplicaReducer([ReplicatedKernel(kernel, dist.group.WORLD, [0, 1], SHARDS)], sync_dtype)
        if overlap:  # a round in flight already, as with sync_overlap after the first interval
            reducer.launch()
        a_step(kernel, rank)
        if rank == 1:  # the spoiled copy
            spoil(kernel, place, BAD[bad])
        out.append(round_and_flush(reducer, kernel, overlap, sync_dtype))
    return out


CASES = [(sync_dtype, overlap, place, bad) for sync_dtype in ("fp32", "bf16", "int8") for overlap in (False, True)
         for place in PLACES for bad in BAD]


@pytest.mark.parametrize("sync_dtype", ["fp32", "bf16", "int8"])
def test_a_non_finite_row_on_one_copy_stops_every_rank_and_changes_nothing(sync_dtype):
    cases = [case for case in CASES if case[0] == sync_dtype]
    zero, one = run_distributed(_pair_worker, 2, cases, timeout=240)
    for case, mine, other in zip(cases, zero, one, strict=True):
        _, overlap, place, bad = case
        table = SHARDS[PLACES[place][0]].table
        assert mine["error"] is not None and other["error"] is not None, f"{case}: a rank went on"
        assert mine["error"] == other["error"], f"{case}: the ranks raised different errors"
        message = mine["error"]
        assert "non-finite" in message and "NaN or inf" in message, message
        assert f"table '{table}'" in message and "rank 1" in message and "rank 0" not in message, message
        assert mine["unchanged"] and other["unchanged"], f"{case}: a copy changed although the round stopped"
        assert mine["flushed"] == other["flushed"], f"{case}: the ranks' flushes disagree"
        assert mine["finite"], f"{case}: a later flush of the residuals carried the spoiled copy's values over"


def _mesh_worker(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """A 2 x 2 mesh: replica groups {0, 2} and {1, 3}, shard groups {0, 1} and {2, 3}; rank 2 spoils
    a row. With ``bare``, ranks 1 and 3 hold no replicated shard."""
    import torch.distributed as dist

    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = []
    for sync_dtype, overlap, bare in cases:
        kernel = make_kernel(SHAPES, [0, 1])
        replica, peers = replicas[rank % 2], [rank % 2, rank % 2 + 2]
        held = [] if bare and rank % 2 else [ReplicatedKernel(kernel, replica, peers, SHARDS)]
        reducer = ReplicaReducer(held, sync_dtype, across=shards[rank // 2])
        if overlap:
            reducer.launch()
        a_step(kernel, rank // 2)
        if rank == 2:
            spoil(kernel, "own row", float("nan"))
        out.append(round_and_flush(reducer, kernel, overlap, sync_dtype))
    return out


def test_every_rank_of_a_mesh_stops_together_also_the_other_replica_group():
    cases = [(sync_dtype, overlap, bare) for sync_dtype in ("fp32", "bf16", "int8") for overlap in (False, True)
             for bare in (False, True)]
    results = run_distributed(_mesh_worker, 4, cases, timeout=300)
    for index, case in enumerate(cases):
        errors = [result[index]["error"] for result in results]
        assert all(error is not None for error in errors), f"{case}: ranks went on: {errors}"
        assert len(set(errors)) == 1, f"{case}: the ranks raised different errors: {errors}"
        assert "table 'big_table'" in errors[0] and "rank 2" in errors[0], errors[0]
        assert all(result[index]["unchanged"] for result in results), f"{case}: a copy changed"


def _in_flight_worker(rank: int, world_size: int, sync_dtype: str) -> dict:
    """A spoiled round in flight while rows are touched; the next launch applies it and stops."""
    import torch.distributed as dist

    kernel = make_kernel(SHAPES, [0, 1])
    reducer = ReplicaReducer([ReplicatedKernel(kernel, dist.group.WORLD, [0, 1], SHARDS)], sync_dtype)
    a_step(kernel, rank)
    if rank == 1:
        spoil(kernel, "own row", float("nan"))
    reducer.launch()
    look_up(kernel, [[7, 9 + rank], []])  # touched while the spoiled round is on the wire
    error = a_round(reducer, overlap=True)
    return dict(error=error, marked=[t.mask.nonzero().flatten().tolist() for t in reducer.groups[0].touched])


@pytest.mark.parametrize("sync_dtype", ["fp32", "bf16"])
def test_rows_touched_while_a_spoiled_round_flies_stay_marked_for_the_next_round(sync_dtype):
    """The next launch takes the row masks before it applies the round in flight (the copies agree on
    the rows meanwhile): when that round stops on NaN, the rows go back to the masks."""
    results = run_distributed(_in_flight_worker, 2, sync_dtype, timeout=120)
    assert all(result["error"] is not None and "rank 1" in result["error"] for result in results), results
    assert [result["marked"] for result in results] == [[[7, 9]], [[7, 10]]]


def _gradients_worker(rank: int, world_size: int, bad: str) -> dict:
    import torch.distributed as dist

    kernel = make_kernel(SHAPES, [0, 1])
    replicated = ReplicatedKernel(kernel, dist.group.WORLD, [0, 1], SHARDS)
    values = torch.full((2, 4), 0.1 * (rank + 1))
    if rank == 0:
        values[1, 2] = BAD[bad]
    kernel.shard_weights[0].grad = torch.sparse_coo_tensor(torch.tensor([[3, 7 + rank]]), values, (40, 4))
    before = bits(kernel)
    try:
        step_with_mean_gradients([replicated])
        error = None
    except NonFiniteError as err:
        error = str(err)
    return dict(error=error, unchanged=all(torch.equal(a, b) for a, b in zip(before, bits(kernel), strict=True)))


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_gradient_on_one_copy_stops_every_rank_before_the_update(bad):
    zero, one = run_distributed(_gradients_worker, 2, bad, timeout=120)
    assert zero["error"] is not None and zero["error"] == one["error"], (zero, one)
    assert "non-finite" in zero["error"] and "table 'big_table'" in zero["error"] and "rank 0" in zero["error"]
    assert zero["unchanged"] and one["unchanged"], "no row may be updated with the spoiled mean"


SPOILED_STEP = 2  # the optimizer step before which rank 2 spoils its copy


def _fit_worker(rank: int, world_size: int, port: int, fits: list[dict]) -> list[str | None]:
    """Lightning fits on a 2 x 2 mesh in which rank 2 spoils its copy at one step: every table's
    weights (``sync_mode="weights"``) or gradients (``"gradients"``) become NaN there."""
    import lightning.pytorch as pl

    from lightning_twod import TwoDSparseStrategy
    from tests.helpers import strategy_cases as C

    class Spoiler(TwoDSparseStrategy):
        def sparse_step(self) -> None:
            if self.global_rank == 2 and self.schedule.steps == SPOILED_STEP:
                kernel = self._replicated[0].kernel
                with torch.no_grad():
                    for weight in kernel.shard_weights:
                        if self.options.sync_mode == "weights":
                            weight.fill_(float("nan"))
                        elif weight.grad is not None:
                            weight.grad = weight.grad * float("nan")
            super().sparse_step()

    C.as_external_rank(rank, world_size, port)
    errors = []
    for fit in fits:
        lit = C.LitDLRM(C.make_net("collection"), 0.1, num_samples=6 * C.WORLD * C.LOCAL_BATCH)
        strategy = Spoiler(shard_group_size=2, kernel_backend="torch", sync_interval=1, **fit)
        try:
            pl.Trainer(devices=world_size, strategy=strategy, **C.trainer_kwargs(6)).fit(lit)
            errors.append(None)
        except NonFiniteError as err:
            errors.append(str(err))
    return errors


def test_a_fit_stops_on_every_rank_when_one_copy_turns_non_finite():
    """The engine names the tables, joins the replica groups through the shard group, and Lightning
    lets the same error out of ``fit`` on every rank: blocking fp32, overlapped int8, gradients."""
    from tests.helpers.strategy_cases import free_port

    fits = [dict(sync_dtype="fp32"), dict(sync_dtype="int8", sync_overlap=True), dict(sync_mode="gradients")]
    results = run_distributed(_fit_worker, 4, free_port(), fits, timeout=400)
    for index, fit in enumerate(fits):
        errors = [result[index] for result in results]
        assert all(error is not None for error in errors) and len(set(errors)) == 1, f"{fit}: {errors}"
        assert "table 't_" in errors[0] and "on rank 2" in errors[0], errors[0]
        for other in (0, 1, 3):
            assert f"rank {other}" not in errors[0], errors[0]


POISONED_STEP = 3  # the optimizer step whose gradient of feature "user" is NaN on rank 1


def _single_copy_worker(rank: int, world_size: int, port: int, fits: list[dict]) -> list[str | None]:
    """Per-table fits on 4 ranks: ``t_user`` in one group of 4 (a single copy, 1D), the other tables in
    groups of 2 (two copies). At one step rank 1 turns the gradient of its ``user`` pooled columns
    (the first 8) into NaN: only ``t_user`` receives it, and no round would ever see it."""
    import lightning.pytorch as pl

    from lightning_twod import TwoDSparseStrategy
    from tests.helpers import strategy_cases as C

    class Poisoned(C.LitDLRM):
        def training_step(self, batch, batch_idx):
            net = self.net
            pooled = net.sparse(batch["sparse"]).values()
            if self.global_rank == 1 and batch_idx + 1 == POISONED_STEP:
                pooled.register_hook(lambda grad: grad.index_fill(1, torch.arange(8), float("nan")))
            dense = torch.relu(net.bottom(batch["dense"]))
            logits = net.top(torch.cat([dense, pooled], dim=1)).squeeze(1)
            return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["y"])

    C.as_external_rank(rank, world_size, port)
    errors = []
    for fit in fits:
        lit = Poisoned(C.make_net("collection"), 0.1, num_samples=6 * C.WORLD * C.LOCAL_BATCH)
        strategy = TwoDSparseStrategy(shard_group_size=2, sync_interval=2,
                                      sharding={"t_user": {"type": "row_wise", "shard_group_size": 4}}, **fit)
        try:
            pl.Trainer(devices=world_size, strategy=strategy, **C.trainer_kwargs(6)).fit(lit)
            errors.append(None)
        except NonFiniteError as err:
            errors.append(str(err))
    return errors


def test_a_non_finite_gradient_reaching_a_single_copy_stops_every_rank_at_that_step_naming_its_table():
    """Torch kernels, and where FBGEMM is installed its fused updates and the overlapped int8 wire: the
    same error on every rank at the step whose gradient held the NaN, naming ``t_user`` and no other table."""
    from tests.helpers.strategy_cases import free_port

    fits = [dict(kernel_backend="torch")]  # the FBGEMM fits where it is installed
    if fbgemm_available():
        fits += [dict(kernel_backend="fbgemm"), dict(kernel_backend="fbgemm", sync_dtype="int8", sync_overlap=True)]
    results = run_distributed(_single_copy_worker, 4, free_port(), fits, timeout=400)
    for index, fit in enumerate(fits):
        errors = [result[index] for result in results]
        assert all(error is not None for error in errors) and len(set(errors)) == 1, f"{fit}: {errors}"
        assert f"gradients of step {POISONED_STEP} " in errors[0], errors[0]
        assert "table 't_user'" in errors[0] and "t_item" not in errors[0] and "t_cat" not in errors[0], errors[0]
