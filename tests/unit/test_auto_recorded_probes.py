"""``shard_group_size="auto"`` on links recorded on the two-node testbed: the choice each of
``benchmarks/auto.py``'s workloads measured fastest, from probes that disagree.

``tests/data/testbed_1gbit_setup_probes.yaml`` is what the strategy's set-up probe (three 1 s
probes) read on the testbed at 1 Gbit/s on a quiet machine. Two of its probes read the share of an
overlapped all-reduce that compute still pays at 3.6 and 5.0, the third at 0.6. Measured on the
testbed (``docs/benchmarks.md``, auto.py): Criteo-like runs fastest in groups of 2, pooled in 1D,
the skewed model per table (the large table in a group of 4, the others in groups of 2, 1.4-1.5x
faster than 1D).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_twod.planner import DenseModel, LinkModel, PlanRequest, TableSpec, Workload, plan_for_strategy
from lightning_twod.planner.inputs import GIB
from lightning_twod.planner.layout import Outlook, specs_from_configs
from lightning_twod.planner.per_table import PerTableSearch

PROBES = Path(__file__).parents[1] / "data" / "testbed_1gbit_setup_probes.yaml"


def _tables(rows: list[int], pooling_factor: float) -> dict[str, list[TableSpec]]:
    """``auto.py``'s synthetic tables (64 wide) as sampled at set-up: ids skewed 3 (``id = rows * u ** 3``)."""
    return {"sparse": [TableSpec(f"t_cat_{i}", n, 64, pooling_factor=pooling_factor, id_skew=3.0)
                       for i, n in enumerate(rows)]}


# workload -> (tables, batch per rank, memory per rank, dense parameters of the bundled DLRM)
WORKLOADS = {
    "criteo": (_tables([100_000] * 26, 1.0), 4096, 4 * GIB, 159_553),
    "pooled": (_tables([100_000] * 8, 10.0), 1024, 4 * GIB, 78_913),
    "skewed": (_tables([4_000_000] + [100_000] * 26, 1.0), 4096, 1.75 * GIB, 166_465),
}


def _plan(name: str, links: LinkModel):
    tables, batch, memory, dense = WORKLOADS[name]
    workload = Workload(batch_size=batch, optimizer="rowwise_adagrad", sync_interval=8, sync_bytes=2,
                        sync_overlap=True)
    request = PlanRequest(4, 2, memory, workload, placement="contiguous", links=links, dense=DenseModel(dense))
    return plan_for_strategy(tables, request), request


def test_the_recorded_probes_disagree_on_the_overlap_share():
    links = LinkModel.load(PROBES)
    assert len(links.samples) == 3
    assert sorted(round(s.overlap_share, 1) for s in links.samples) == [0.6, 3.6, 5.0]
    assert links.overlap_share == min(s.overlap_share for s in links.samples)


@pytest.mark.parametrize("name, group_size, per_table", [("criteo", 2, False), ("pooled", 4, False),
                                                         ("skewed", 2, True)])
def test_auto_chooses_what_the_testbed_measured_fastest(name, group_size, per_table):
    planned, _ = _plan(name, LinkModel.load(PROBES))
    assert planned.plan.shard_group_size == group_size, planned.explanation
    assert planned.plan.per_table == per_table, planned.explanation
    if per_table:
        assert planned.plan.modules["sparse"]["t_cat_0"].size_in(group_size) == 4
        head = planned.explanation.splitlines()[0]
        assert "each table its own group size" in head and "faster on the probes' fastest numbers" in head


def test_on_the_skewed_model_the_probes_median_would_have_kept_1d():
    """What a rule asking for the gain at the probes' median too made of the same numbers: the per-table
    layout is slower than 1D on two probes of three, by far on the one that read the overlap share at 5.0."""
    links = LinkModel.load(PROBES)
    _, request = _plan("skewed", links)
    tables = specs_from_configs(WORKLOADS["skewed"][0])
    search = PerTableSearch(tables, 4, "contiguous", 2, request.memory_per_rank_bytes, request.workload, links,
                            request.dense)
    one_d = search.evaluate(dict.fromkeys(search.tables, 4))
    per_table = search.evaluate({**dict.fromkeys(search.tables, 2), "t_cat_0": 4})
    outlooks = [Outlook.of(lambda on, a=a: search.total_on(a, on), links) for a in (one_d, per_table)]
    slower = [p > o for o, p in zip(outlooks[0].probes, outlooks[1].probes, strict=True)]
    assert sum(slower) == 2 and outlooks[1].fast < 0.9 * outlooks[0].fast
