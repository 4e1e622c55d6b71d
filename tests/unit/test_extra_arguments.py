"""The strategies' keyword arguments beyond the 2D options: what Lightning's ``DDPStrategy`` or
``DistributedDataParallel`` takes passes on; anything else (a typo, TorchRec's name, what Lightning
sets itself) raises ``OptionError`` where the strategy is made, naming what to use instead."""

from __future__ import annotations

import re

import pytest

from lightning_twod.strategies.fabric import TwoDSparseFabricStrategy
from lightning_twod.strategies.options import OptionError
from lightning_twod.strategies.strategy import TwoDSparseStrategy

STRATEGIES = [TwoDSparseStrategy, TwoDSparseFabricStrategy]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("arguments", "message"), [
    (dict(sync_intervall=8), "unknown argument sync_intervall=8 (did you mean sync_interval?)"),
    (dict(shard_groupsize=2), "unknown argument shard_groupsize=2 (did you mean shard_group_size?)"),
    (dict(find_unused_parameter=True), "unknown argument find_unused_parameter=True "
                                       "(did you mean find_unused_parameters?)"),
])
def test_a_typo_names_the_closest_argument(strategy, arguments, message):
    with pytest.raises(OptionError, match=f"^{strategy.__name__}: {re.escape(message)}$"):
        strategy(**arguments)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "ours"), [
    ("sharding_group_size", "shard_group_size"),
    ("use_inter_host_allreduce", "placement ('contiguous' for True, 'strided' for False)"),
    ("constraints", "sharding (per table a type"),
    ("learning_rate", "sparse_lr"),
    ("fused_params", "sparse_optimizer, sparse_lr and sparse_eps"),
])
def test_torchrecs_name_names_ours(strategy, name, ours):
    with pytest.raises(OptionError, match=f"^{strategy.__name__}: {name}=2 is TorchRec's argument; "
                                          f"here it is {re.escape(ours)}"):
        strategy(**{name: 2})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_bad_argument_is_named_in_one_message(strategy):
    with pytest.raises(OptionError) as raised:
        strategy(sync_intervall=8, sharding_group_size=2, device_ids=[0], shard_group_size=2)
    assert str(raised.value) == (
        f"{strategy.__name__}: unknown argument sync_intervall=8 (did you mean sync_interval?); "
        "sharding_group_size=2 is TorchRec's argument; here it is shard_group_size; "
        "device_ids=[0] is set by Lightning (the LightningModule and the Trainer's devices); drop it")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_name_like_no_argument_lists_what_goes_to_ddp(strategy):
    with pytest.raises(OptionError, match=r"unknown argument qqq=1 \(the 2D options are in docs/configuration.md; "
                                          r"other keyword arguments go to DistributedDataParallel: .*static_graph"):
        strategy(qqq=1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_what_ddp_and_lightning_take_passes_on(strategy):
    ddp = dict(find_unused_parameters=True, static_graph=False, bucket_cap_mb=25, gradient_as_bucket_view=True)
    made = strategy(shard_group_size=2, checkpoint_io=None, **ddp)
    assert made._ddp_kwargs == ddp and made.options.shard_group_size == 2
    if strategy is TwoDSparseStrategy:  # Lightning's Trainer strategy has its own DDP communication hooks
        assert TwoDSparseStrategy(ddp_comm_hook=None, model_averaging_period=None)._ddp_kwargs == {}
