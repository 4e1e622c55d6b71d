"""Planner: cost model, balanced sharding plans, ``shard_group_size="auto"``, at-scale simulator.

Works on table shapes and lookup statistics only (never on modules or process groups):

* ``cost``: storage, traffic and time estimators, hardware constants with units and sources;
* ``plan``: ``ShardingPlan`` (table printout, YAML round trip) and its per-rank report;
* ``planner``: the partitioner, automatic group size and ``plan_for_strategy`` for
  ``TwoDSparseStrategy``;
* ``simulate``: the analytic step-time model of 1D and 2D from 8 to 4,096 GPUs;
* ``commands``: ``python -m lightning_twod plan|simulate``.
"""

from lightning_twod.planner.cost import (
    A100_P4D, H100, HARDWARE, Hardware, Links, RankLoad, RankStorage, TableSpec, Workload, predict_load,
    predict_storage, predict_traffic,
)
from lightning_twod.planner.planner import (
    PlanError, StrategyPlan, candidate_group_sizes, choose_group_size, evaluate, partition, plan_for_strategy,
    plan_model, specs_from_configs,
)
from lightning_twod.planner.plan import PlanReport, ShardingPlan, validate_shardings

__all__ = [
    "A100_P4D", "H100", "HARDWARE", "Hardware", "Links", "PlanError", "PlanReport", "RankLoad", "RankStorage",
    "ShardingPlan", "StrategyPlan", "TableSpec", "Workload", "candidate_group_sizes", "choose_group_size",
    "evaluate", "partition", "plan_for_strategy", "plan_model", "predict_load", "predict_storage",
    "predict_traffic", "specs_from_configs", "validate_shardings",
]
