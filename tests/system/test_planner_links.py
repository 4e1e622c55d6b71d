"""The links probe on real processes: one answer for every rank (and again in the same job), one error
for every rank when it fails, one ``auto`` layout decision in a fit, and the file ``calibrate`` writes
read by the strategy."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_twod import TwoDSparseStrategy
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the probe
def _probe_worker(rank: int, world: int, fail_rank: int | None, probes: int = 1, fail_in: str = "collective"):
    import lightning_twod.hardware.probe as probe

    if rank == fail_rank and fail_in == "collective":  # the link "goes down" before the all-reduce measurements
        original = probe._Probe.collective

        def broken(self, kind, across, share):
            if kind == "all_reduce":
                raise ConnectionError("link to the other node is down")
            return original(self, kind, across, share)

        probe._Probe.collective = broken
    elif rank == fail_rank:  # ... or in the overlap share's measurement, after the three probes

        def broken_overlap(self, *args):
            raise ConnectionError("link to the other node is down")

        probe._Probe.overlap_share = broken_overlap
    try:
        measured = [probe.measure(2, torch.device("cpu"), budget_s=1.0, timeout_s=10.0) for _ in range(probes)]
    except Exception as err:  # noqa: BLE001 (reported to the test)
        return {"error": (type(err).__name__, str(err))}
    dist.barrier()  # the world group still works after the probe
    return {"links": [links.to_container() for links in measured]}


def test_the_probe_gives_every_rank_rank_0s_numbers_and_runs_again_in_the_same_job():
    results = run_distributed(_probe_worker, 4, None, 2, timeout=120)
    assert all(len(r["links"]) == 2 for r in results)
    assert all(r["links"][1] == results[0]["links"][1] for r in results)  # the second probe agrees too
    first = results[0]["links"][0]
    assert all(r["links"][0] == first for r in results)
    assert first["ranks_per_node"] == 2 and first["name"] == "measured"
    assert len(first["repeats"]) == 3 and "the fastest of 3 probes" in first["source"]
    for kind in ("all_to_all", "all_reduce"):
        for scope in ("intra_node", "inter_node"):
            assert first[kind][scope]["bandwidth_gbps"] > 0 and first[kind][scope]["latency_us"] >= 0
    assert all(first["compute"][key] > 0 for key in ("lookup_gbps", "copy_gbps", "dense_tflops"))
    assert math.isfinite(first["overlap_share"]) and first["overlap_share"] >= 0
    assert {r["overlap_share"] for r in first["repeats"]} == {first["overlap_share"]}  # measured once


def test_a_failing_probe_raises_the_same_error_on_every_rank():
    results = run_distributed(_probe_worker, 4, 1, timeout=120)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    kind, message = errors.pop()
    assert "link to the other node is down" in message and "rank 1" in message


def test_a_probe_failing_in_the_overlap_measurement_raises_on_every_rank():
    results = run_distributed(_probe_worker, 4, 1, 1, "overlap", timeout=120)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # one error, the same on every rank, no hang
    kind, message = errors.pop()
    assert "link to the other node is down" in message and "rank 1" in message


# ----------------------------------------------------------------------------- the links cache
def _setup_links_worker(rank: int, world: int, folders: list[str]):
    """Three set-ups' links on one job: ``"auto"`` twice, then ``"measure"``; rank 0's cache is
    ``folders[0]``, the other ranks' ``folders[1]``. Rank 0's entry starts out as a broken file."""
    import warnings

    import lightning_twod.hardware.resolve as resolve
    from lightning_twod.planner.link_cache import CACHE_ENV

    os.environ[CACHE_ENV] = folders[0 if rank == 0 else 1]
    probes = []
    measure = resolve.measure

    def counted(*args, **kwargs):
        probes.append(rank)
        return measure(*args, **kwargs)

    resolve.measure = counted
    device = torch.device("cpu")
    key = resolve.job_key(dist.group.WORLD, 2, device)
    if rank == 0:
        (Path(folders[0]) / "links").mkdir(parents=True)
        (Path(folders[0]) / "links" / key.file_name()).write_text("all_to_all: [unclosed\n")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        first = resolve.planning_links("auto", dist.group.WORLD, 2, device, chosen_by_cost=True)
    probed = [len(probes)]
    second = resolve.planning_links("auto", dist.group.WORLD, 2, device, chosen_by_cost=True)
    probed.append(len(probes))
    third = resolve.planning_links("measure", dist.group.WORLD, 2, device, chosen_by_cost=True)
    probed.append(len(probes))
    return {"probed": probed, "warned": [str(w.message) for w in warned], "key": key.to_container(),
            "links": [links.to_container() for links in (first, second, third)]}


def test_a_second_set_up_reads_the_links_rank_0_kept_and_every_rank_plans_on_the_same_numbers(tmp_path):
    folders = [str(tmp_path / "rank0"), str(tmp_path / "others")]
    results = run_distributed(_setup_links_worker, 4, folders, timeout=180)
    assert all(r["probed"] == [1, 1, 2] for r in results), [r["probed"] for r in results]  # the second: no probe
    for i in range(3):
        assert all(r["links"][i] == results[0]["links"][i] for r in results), f"set-up {i + 1} differs between ranks"
    first, second, third = results[0]["links"]
    numbers = [{k: v for k, v in links.items() if k != "source"} for links in (first, second, third)]
    assert numbers[0] == numbers[1] != numbers[2] and len(second["repeats"]) == 3
    assert "kept in the links cache" in first["source"] and "from the links cache" in second["source"]
    assert results[0]["key"]["world_size"] == 4 and results[0]["key"]["ranks_per_node"] == 2
    assert any("cannot be read" in w and "measuring the links again" in w for w in results[0]["warned"])
    assert not any(r["warned"] for r in results[1:])  # only rank 0 reads the cache
    entries = list((tmp_path / "rank0" / "links").glob("links-*.yaml"))
    assert len(entries) == 1 and not (tmp_path / "others").exists()
    import yaml

    kept = yaml.safe_load(entries[0].read_text())["links"]  # the third set-up measured again and replaced it
    assert {k: v for k, v in kept.items() if k != "source"} == numbers[2]


# ----------------------------------------------------------------------------- the strategy and the command
def _fit_worker(rank: int, world: int, port: int, links):
    import lightning.pytorch as pl

    from tests.helpers import strategy_cases as C

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                      NODE_RANK=str(rank // 2), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    strategy = TwoDSparseStrategy(shard_group_size="auto", placement="auto", links=links, timeout=60,
                                  planner_batch_size=C.LOCAL_BATCH)
    module = C.LitDLRM(C.make_net(), 0.2, num_samples=2 * world * C.LOCAL_BATCH)
    trainer = pl.Trainer(devices=2, num_nodes=2, strategy=strategy, **C.trainer_kwargs(2))
    trainer.fit(module)
    dims = strategy.mesh_groups.dims
    return {"layout": (dims.shard_group_size, dims.placement), "plan": strategy.sharding_plan.to_yaml()}


def test_auto_layout_in_a_fit_is_one_decision_on_measured_links():
    from tests.helpers.strategy_cases import free_port

    results = run_distributed(_fit_worker, 4, free_port(), "measure", timeout=300)
    assert len({r["plan"] for r in results}) == 1 and len({r["layout"] for r in results}) == 1
    size, placement = results[0]["layout"]
    assert size in (1, 2, 4) and placement in ("contiguous", "strided")


def test_calibrate_command_writes_a_file_the_strategy_reads(tmp_path):
    out = tmp_path / "links.yaml"
    done = subprocess.run([sys.executable, "-m", "lightning_twod", "calibrate", "--nproc", "2", "--budget-s", "0.5",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "all_to_all intra" in done.stdout and f"written to {out}" in done.stdout
    assert "kept in the links cache" in done.stdout  # set-ups of links="auto" on this host read them
    links = TwoDSparseStrategy(links=str(out)).options.links
    assert links.ranks_per_node == 2 and math.isfinite(links.all_to_all_intra.bandwidth)
    assert "calibrate on 2 ranks" in links.source
