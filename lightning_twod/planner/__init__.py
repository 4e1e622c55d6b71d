"""Planner: cost model, balanced sharding plans, the layout by predicted step time, simulator.

Works on table shapes, lookup statistics and link numbers only (never on modules or process groups),
and imports neither torch nor Lightning:

* ``inputs``: ``TableSpec`` (a table's shape and lookups), ``Workload`` (batch, optimizer, wire types);
* ``slots``: a plan's shards as each shard position reads them;
* ``traffic``, ``reduction``, ``storage``: bytes sent per step, bytes of the cross-group
  reduction, bytes held;
* ``load``: seconds a shard costs its owner, summed per rank (what the partitioner balances);
* ``links``: ``LinkModel`` (links and compute of a rank: measured, from a YAML file, or a preset);
* ``hardware``: datasheet numbers and efficiency assumptions of the presets;
* ``steptime``: predicted seconds of one step by phase, for any layout;
* ``plan``: ``ShardingPlan`` (table printout, YAML round trip) and its per-rank report;
* ``partition``: the partitioner (``partition``) and ``plan_model`` at one group size;
* ``evaluate``: what a plan costs each rank (``PlanReport``), a shard group's links;
* ``layout``: ``choose_layout`` (group size and placement by predicted step time) and
  ``plan_for_strategy`` for the strategies;
* ``memory``: the per-rank memory breakdown by category;
* ``simulate``, ``simreport``: the at-scale model of 1D and 2D from 8 to 4,096 GPUs, its table and plot.

Imports go to ``core`` only (shards, the mesh arithmetic, the reduction's rules); the commands
``lightning-twod plan|simulate`` are in ``cli``.
"""

from lightning_twod.planner.evaluate import evaluate
from lightning_twod.planner.hardware import A100_P4D, H100, HARDWARE, Hardware
from lightning_twod.planner.inputs import TableSpec, Workload
from lightning_twod.planner.layout import (
    Candidate,
    PlanRequest,
    StrategyPlan,
    choose_layout,
    layout_options,
    plan_for_strategy,
    specs_from_configs,
)
from lightning_twod.planner.links import PRESETS, CollectiveCost, LinkModel, resolve_links
from lightning_twod.planner.load import GroupLinks, RankLoad, predict_load
from lightning_twod.planner.partition import PlanError, partition, plan_model
from lightning_twod.planner.plan import PlanReport, ShardingPlan, validate_shardings
from lightning_twod.planner.steptime import DenseModel, StepTime, step_time
from lightning_twod.planner.storage import RankStorage, predict_storage
from lightning_twod.planner.traffic import predict_traffic

__all__ = [
    "A100_P4D", "H100", "HARDWARE", "PRESETS", "Candidate", "CollectiveCost", "DenseModel", "GroupLinks",
    "Hardware", "LinkModel", "PlanError", "PlanReport", "PlanRequest", "RankLoad", "RankStorage", "ShardingPlan",
    "StepTime", "StrategyPlan", "TableSpec", "Workload", "choose_layout", "evaluate", "layout_options", "partition",
    "plan_for_strategy", "plan_model", "predict_load", "predict_storage", "predict_traffic", "resolve_links",
    "specs_from_configs", "step_time", "validate_shardings",
]
