"""The strategies' ``lookup_stats`` option: checked at construction, its tables checked against the model,
and ``"auto"`` estimating the statistics from the first training batch without touching the loader (one
process, no process group; the statistics reaching every rank: ``tests/system/test_lookup_stats.py``)."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler

from lightning_twod import TwoDSparseFabricStrategy, TwoDSparseStrategy
from lightning_twod.models.dlrm import DLRM
from lightning_twod.planner.links import resolve_links
from lightning_twod.strategies.options import TwoDOptions
from lightning_twod.strategies.planning import first_batch
from tests.helpers.pooled_data import PooledClicks, PooledDataModule

ROWS = [5000, 300]
LINKS = resolve_links("h100")


def _strategy(**options) -> TwoDSparseStrategy:
    strategy = TwoDSparseStrategy(links="h100", **options)
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)  # sets the strategy's devices
    return strategy


def _data(**kwargs) -> PooledDataModule:
    data = PooledDataModule(ROWS, batch_size=256, **kwargs)
    data.setup("fit")
    return data


def _model() -> DLRM:
    return DLRM(table_rows=ROWS, num_dense=4, embedding_dim=8, bottom_mlp=[8], top_mlp=[8])


@pytest.mark.parametrize(("bad", "match"), [
    (12, "lookup_stats=12; use 'auto' (sampled from the training data), None, or {table: {field: value}} with "
         "the fields pooling_factor, id_skew, hashed, weighted"),
    ({"t_cat_0": {"skew": 3}}, "lookup_stats: table 't_cat_0' has unknown fields ['skew']; the fields are "
                               "['pooling_factor', 'id_skew', 'hashed', 'weighted']"),
    ({"t_cat_0": {"id_skew": 0}}, "lookup_stats: table 't_cat_0': id_skew=0; use a number > 0"),
    ({"t_cat_0": {"pooling_factor": "many"}}, "lookup_stats: table 't_cat_0': pooling_factor='many'"),
    ({"t_cat_0": {"hashed": "yes"}}, "lookup_stats: table 't_cat_0': hashed='yes'; use True or False"),
])
def test_a_bad_value_names_the_option_the_table_and_the_field(bad, match):
    with pytest.raises(ValueError, match=f"^TwoDSparseStrategy: {re.escape(match)}"):
        TwoDSparseStrategy(lookup_stats=bad)
    with pytest.raises(ValueError, match=f"^TwoDSparseFabricStrategy: {re.escape(match)}"):
        TwoDSparseFabricStrategy(lookup_stats=bad)


def test_a_mapping_is_kept_as_dicts_and_auto_and_none_as_they_are():
    given = {"t_cat_0": {"pooling_factor": 4, "id_skew": 2.0}}
    assert TwoDOptions(lookup_stats=given).lookup_stats == given
    assert TwoDOptions().lookup_stats == "auto" and TwoDOptions(lookup_stats=None).lookup_stats is None


def test_a_table_the_model_does_not_have_fails_before_launch_and_at_set_up():
    message = ("TwoDSparseStrategy: lookup_stats names unknown tables ['t_nope']; the model's tables are "
               "['t_cat_0', 't_cat_1']")
    strategy = _strategy(lookup_stats={"t_nope": {"id_skew": 2.0}})
    with pytest.raises(MisconfigurationException, match=f"^{re.escape(message)}$"):
        strategy.check_before_launch(_model())
    with pytest.raises(MisconfigurationException, match=f"^{re.escape(message)}$"):
        strategy.plan_layout(_model(), 2**30, LINKS, _data())


class _Refusing(Sampler):
    """A sampler that fails when iterated: the first batch must be built without it."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        raise AssertionError("the loader's sampler was iterated")

    def __len__(self) -> int:
        return self.size


def test_the_first_batch_is_built_from_the_dataset_without_iterating_the_loader():
    data = PooledClicks(ROWS, 100)
    loader = DataLoader(data, batch_size=7, sampler=_Refusing(100), collate_fn=data.collate, num_workers=2)
    rng = torch.get_rng_state()
    batch, why = first_batch(loader)
    assert why == "" and batch["sparse"].batch_size == 7
    assert batch["sparse"].equal(data.collate([data[i] for i in range(7)])["sparse"])
    assert torch.equal(torch.get_rng_state(), rng)  # no worker seed drawn, no shuffle
    one, _ = first_batch(DataLoader(data, batch_size=None, collate_fn=lambda item: item))
    assert one["ids"] == data[0]["ids"]  # no batching: the first item is the batch
    batches = DataLoader(data, batch_size=None, sampler=BatchSampler(SequentialSampler(data), 7, False))
    assert first_batch(batches) == (None, "the train dataloader's BatchSampler chooses what a batch's index is")


def test_auto_plans_on_the_first_batchs_statistics_and_says_so():
    strategy, model, data = _strategy(lookup_stats="auto"), _model(), _data()
    rng = torch.get_rng_state()
    planned = strategy.plan_layout(model, 2**30, LINKS, data)
    assert torch.equal(torch.get_rng_state(), rng)  # the shuffling loader was not iterated
    stats, _ = strategy.lookup_stats(_model())
    assert set(stats) == {"t_cat_0", "t_cat_1"}
    for entry in stats.values():  # bags of 1 to 19 ids: 10 on average; skew 3 on the lowest ids
        assert entry["pooling_factor"] == pytest.approx(10.0, rel=0.15)
        assert entry["id_skew"] == pytest.approx(3.0, rel=0.3) and entry["hashed"] is False
    head = planned.explanation.splitlines()[0]
    assert re.search(r"; lookup stats: ids per feature [\d.]+-[\d.]+, id_skew [\d.]+-[\d.]+ \(sampled from the first "
                     r"training batch, 256 samples\)$", head), head
    rows = strategy.table_rows(_model(), planned.plan, LINKS, _data())  # predicted on the same statistics
    plain = _strategy(lookup_stats=None)
    assert plain.plan_layout(_model(), 2**30, LINKS, _data()).explanation.splitlines()[0].endswith(
        "; lookup stats: none (lookup_stats=None: one id a feature, uniform)")
    assert [r.to_dict() for r in rows] != [r.to_dict() for r in plain.table_rows(_model(), planned.plan, LINKS, _data())]


def test_given_fields_win_over_the_sampled_ones_for_the_tables_they_name():
    strategy = _strategy(lookup_stats={"t_cat_1": {"pooling_factor": 2.5, "hashed": True}})
    stats, note = strategy.lookup_stats(_model(), _data())
    assert stats["t_cat_1"]["pooling_factor"] == 2.5 and stats["t_cat_1"]["hashed"] is True
    assert stats["t_cat_1"]["id_skew"] == pytest.approx(3.0, rel=0.3)  # not given: sampled
    assert stats["t_cat_0"]["pooling_factor"] == pytest.approx(10.0, rel=0.15)
    assert note.endswith("(sampled from the first training batch, 256 samples; given for 1 table(s))")


@pytest.mark.parametrize(("strategy", "data", "said"), [
    (dict(lookup_stats="auto"), dict(streamed=True),
     "lookup stats: one id a feature, uniform (the training data is an IterableDataset (its first batch is not read "
     "without iterating it): none sampled (give lookup_stats={table: {pooling_factor, id_skew, hashed, weighted}}))"),
    (dict(lookup_stats="auto", shard_group_size=1), {},
     "lookup stats: one id a feature, uniform (none sampled: the layout is fixed)"),
    (dict(lookup_stats={"t_cat_0": {"pooling_factor": 3}}, shard_group_size=1), {},
     "lookup stats: ids per feature 3, id_skew 1 (none sampled: the layout is fixed; given for 1 table(s))"),
])
def test_where_nothing_is_sampled_the_plan_says_why_and_the_fix(strategy, data, said):
    planned = _strategy(**strategy).plan_layout(_model(), 2**30, LINKS, _data(**data))
    assert planned.explanation.splitlines()[0].endswith(f"; {said}")


def test_fabric_takes_a_mapping_only():
    strategy = TwoDSparseFabricStrategy(links="h100", lookup_stats={"t_cat_0": {"pooling_factor": 3}})
    Fabric(accelerator="cpu", devices=1, strategy=strategy)
    planned = strategy.plan_layout(_model(), 2**30, LINKS)
    assert planned.explanation.splitlines()[0].endswith(
        "; lookup stats: ids per feature 3, id_skew 1 (none sampled: Fabric sees no training data at set-up; give "
        "lookup_stats={table: {pooling_factor, id_skew, hashed, weighted}}; given for 1 table(s))")


@pytest.mark.parametrize(("fn", "said"), [
    (TrainerFn.FITTING, "(sampled from the first training batch, 256 samples)"),
    (TrainerFn.VALIDATING, "(validate reads no training data: none sampled (give lookup_stats="),
])
def test_the_trainer_samples_what_it_fits_on_and_nothing_outside_fit(fn, said):
    strategy, model, data = TwoDSparseStrategy(links="h100"), _model(), _data()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    trainer._data_connector.attach_data(model, datamodule=data)  # what fit and validate do before set-up
    trainer.state.fn = fn
    model.trainer = trainer
    _, note = strategy.lookup_stats(model)
    assert said in note
