"""The benchmark scripts stay runnable: syntax, a dry run of the GPU script on CPU, a tiny kernels run.

Nothing here is timed: the benchmarks' numbers live in docs/benchmarks.md (headlines) and benchmarks/results/, measured by hand.
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.benchmark_scripts import load_benchmark
from tests.helpers.distributed import run_distributed

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_benchmark_script_compiles(tmp_path):
    scripts = sorted(BENCH.glob("*.py"))
    assert {p.name for p in scripts} >= {"throughput.py", "kernels.py", "gpu_bandwidth.py", "torchrec_worker.py",
                                         "workload.py"}
    for path in scripts:
        py_compile.compile(str(path), cfile=str(tmp_path / (path.name + "c")), doraise=True)
    shells = sorted(BENCH.glob("*.sh"))
    assert {p.name for p in shells} >= {"gpu.sh", "setup_torchrec.sh"}
    for path in shells:
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


def test_gpu_script_names_existing_files_and_options():
    text = (BENCH / "gpu.sh").read_text()
    for path in re.findall(r"(?:tests|benchmarks)/[\w./]+\.py", text):
        assert (BENCH.parent / path).is_file(), f"gpu.sh runs {path}, which does not exist"
    options = set(re.findall(r"--[a-z][a-z-]+", text)) - {"--no-index", "--find-links", "--out"}
    help_text = subprocess.run([sys.executable, str(BENCH / "gpu_bandwidth.py"), "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    for option in options - {"--dry"}:
        assert option in help_text, f"gpu.sh passes {option}, which gpu_bandwidth.py does not take"
    assert "--dry" in help_text and "GPU_DRY" in text  # `GPU_DRY=1 bash benchmarks/gpu.sh` runs everything on CPU


def test_gpu_bandwidth_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu-results"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(BENCH / "gpu_bandwidth.py"), "--dry", "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "gpu_bandwidth.json").read_text())
    assert data["config"]["dry"] and data["device"]["name"] == "cpu"
    assert set(data["variants"]) == {"ours", "raw_torch", "copy"}
    assert all(row["ms"] > 0 and row["achieved_TBps"] > 0 for row in data["variants"].values())
    model = data["bytes_model"]
    assert model["ids"] == 2 * 32 * 2 and 0 < model["unique_rows"] <= model["ids"]
    assert {"input_dist", "lookup", "output_dist", "sparse_update"} <= set(data["variants"]["ours"]["phases_ms"])


def test_kernels_benchmark_tiny_run(tmp_path):
    from lightning_twod.sparse.kernels import fbgemm_available

    variants = "raw,ours,ours_nocheck,torch" if fbgemm_available() else "torch"
    path = tmp_path / "kernels.json"
    cmd = [sys.executable, str(BENCH / "kernels.py"), "--rows", "500", "--dim", "8", "--tables", "3",
           "--batches", "16,64", "--iters", "2", "--repeats", "2", "--warmup", "1", "--variants", variants,
           "--json", str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(path.read_text())
    assert set(data["batches"]) == {"16", "64"}
    for row in data["batches"].values():
        assert set(row["ms"]) == set(variants.split(",")) and all(v > 0 for v in row["ms"].values())
        if "raw" in row["ms"]:
            assert row["ratio_to_raw"]["raw"] == 1.0
            assert {"input_dist", "lookup", "lookup_backward", "output_dist"} <= set(row["phases_ms"]["ours"])
            assert "input_check" in row["phases_ms"]["ours"]  # the phase validate_inputs=False saves is reported


def _timed_ddp(rank: int, world: int, late_s: float) -> list[dict]:
    """Three backward passes of a DDP model with ``workload.timed_allreduce_hook``; rank 1 starts each
    backward ``late_s`` after rank 0, so rank 0's all-reduce ends that much after its own backward."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from lightning_twod.sparse.timing import PhaseTimer

    sys.path.insert(0, str(BENCH))
    import workload

    torch.manual_seed(0)
    timer = PhaseTimer()
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 1)),
                                    bucket_cap_mb=0.05)  # several buckets
    hook = workload.timed_allreduce_hook(timer)
    model.register_comm_hook(None, hook)
    steps = []
    for _ in range(3):
        timer.reset()
        loss = model(torch.randn(32, 64)).sum()
        if rank == 1:
            time.sleep(late_s)
        start = time.perf_counter()
        loss.backward()
        steps.append({"backward": time.perf_counter() - start, **timer.seconds, "calls": dict(timer.calls),
                      "mark": hook.marks[-1]})
    return steps


def test_timed_allreduce_hook_measures_what_the_step_waits_for():
    early, late = run_distributed(_timed_ddp, 2, 0.3, timeout=120)
    for rank in (early, late):
        for step in rank:  # one wait a backward, inside the span, inside the backward
            assert step["calls"]["dense_wait"] == 1
            assert 0.0 <= step["dense_wait"] <= step["dense_allreduce"] <= step["backward"]
    for first, second in zip(early, late, strict=True):
        # the rank that started first waited for the other's buckets after its own work, most of its
        # backward; the late one found the first's buckets launched and waited less
        assert first["dense_wait"] > second["dense_wait"]
        assert first["dense_wait"] > first["backward"] - first["dense_wait"]
        # the marks (one clock on one host) say the late rank ended its backward last, and that
        # its own wait is what the wait of the rank that ended last is
        assert [second["mark"][0] > first["mark"][0], second["mark"][1] - second["mark"][0]] == [
            True, pytest.approx(second["dense_wait"], abs=1e-4)]
    last = load_benchmark("throughput").W.last_rank_wait([[s["mark"] for s in early], [s["mark"] for s in late]])
    assert last == pytest.approx(1e3 * sum(s["dense_wait"] for s in late) / 3, abs=0.1)
