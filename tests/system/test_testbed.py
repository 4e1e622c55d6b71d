"""The two-node testbed of benchmarks/testbed.py: the link is really shaped, a 2x2 fit across the
two namespaces trains exactly what one node does, and the namespaces never outlive a run (success,
a failing node, an exception in the body, Ctrl-C / SIGTERM, a SIGKILLed parent). Needs root and
`ip netns`; skipped with the testbed's own reason otherwise."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import testbed
from tests.helpers.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
TRAIN_TINY = ROOT / "tests" / "helpers" / "scripts" / "train_tiny.py"
TINY_ROWS = [300, 200, 100, 50]  # the model train_tiny.py builds
TIMEOUT = 300  # for hangs only; a healthy job here takes seconds
SHAPED_RATE = "200mbit"


@pytest.fixture(scope="module")
def testbed_available():
    try:
        testbed.preflight()
    except testbed.TestbedUnavailable as error:
        pytest.skip(str(error))


def _namespaces_of(pid: int) -> list[str]:
    return [name for name in testbed.namespaces() if name.startswith(f"{testbed.PREFIX}{pid}-")]


def test_cli_as_a_plain_user_prints_one_line(testbed_available):
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop root")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    script = ROOT / "benchmarks" / "testbed.py"
    if subprocess.run([*as_nobody, "test", "-r", str(script)], check=False).returncode != 0:
        pytest.skip(f"user nobody cannot read {script} (the checkout lies in a private directory)")
    done = subprocess.run([*as_nobody, sys.executable, str(script), "--", "job.py"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "needs root" in done.stderr, done.stderr


def _qdisc_counters(bed, node: int) -> tuple[str, int, int]:
    """(``tc qdisc show`` of node's veth, bytes its root qdisc sent, times the qdisc held a packet back)."""
    shown = subprocess.run(["tc", "-s", "-n", bed.namespaces[node], "qdisc", "show", "dev", bed.veths[node]],
                           capture_output=True, text=True, check=True).stdout
    counted = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped \d+, overlimits (\d+)", shown)
    return shown, int(counted[1]) if counted else 0, int(counted[2]) if counted else 0


def _all_reduce_across(rate: str | None, tmp_path: Path) -> tuple[dict, list[tuple[str, int, int]]]:
    """A 16 MiB all-reduce, a warm-up and 2 repeats, between the two nodes; the job's result and
    each node's qdisc counters after it."""
    out = tmp_path / f"allreduce_{rate}.json"
    with testbed.two_nodes(rate=rate) as bed:
        bed.run(testbed.JOBS, ["allreduce", "--mib", "16", "--repeats", "2", "--out", str(out)], nproc_per_node=1,
                timeout=TIMEOUT, log_dir=tmp_path / f"logs_{rate}").check()
        counters = [_qdisc_counters(bed, node) for node in (0, 1)]
        names = bed.namespaces
    assert not set(names) & set(testbed.namespaces()), "the namespaces outlive the run"
    return json.loads(out.read_text()), counters


def test_shaped_link_carries_the_all_reduce_through_its_token_bucket(testbed_available, tmp_path):
    # Counted, not timed: the bytes each end's token bucket (tbf) let through, and how often it held
    # packets back. 4 Mi float32 = 16,777,216 bytes; each rank's sum needs all of the other rank's
    # buffer, so whatever gloo's algorithm at least that many payload bytes leave each end per
    # all-reduce (TCP/IP headers only add to it): 3 all-reduces with the warm-up. A bucket of 10 ms
    # of traffic at 200 Mbit/s holds 250 kB, so a sender faster than the rate runs it dry many times.
    shaped, counters = _all_reduce_across(SHAPED_RATE, tmp_path)
    assert shaped["bytes"] == 16_777_216 and shaped["world_size"] == 2 and shaped["nodes"] == 2
    for node, (shown, sent, held_back) in enumerate(counters):
        assert "tbf" in shown and "rate 200Mbit" in shown, shown
        assert sent >= 3 * shaped["bytes"], f"node {node}'s bucket passed {sent} bytes:\n{shown}"
        assert held_back > 0, f"node {node}'s bucket never held a packet back:\n{shown}"

    unshaped, counters = _all_reduce_across(None, tmp_path)
    assert all("tbf" not in shown for shown, _, _ in counters), counters
    wire_seconds = shaped["bytes"] * 8 / testbed.parse_rate(SHAPED_RATE)
    print(f"\n16 MiB all_reduce, 2 nodes x 1 rank: {SHAPED_RATE} {shaped['seconds']} s "
          f"(payload at the rate: {wire_seconds:.3f} s), unshaped {unshaped['seconds']} s, "
          f"loadavg {Path('/proc/loadavg').read_text().strip()}")


def _predictions(state_dict: dict) -> torch.Tensor:
    """Logits of the unsharded tiny DLRM with these weights on a fixed batch of validation samples."""
    from lightning_twod.datasets.synthetic import SyntheticClicks
    from lightning_twod.models.dlrm import DLRM

    torch.manual_seed(0)
    model = DLRM(table_rows=TINY_ROWS, embedding_dim=8, bottom_mlp=[16], top_mlp=[16], lr=0.01).eval()
    if state_dict:
        model.load_state_dict(state_dict)
    with torch.no_grad():
        return model(SyntheticClicks(TINY_ROWS, 64, split=1).collate(range(64)))


def test_2x2_across_namespaces_matches_one_node(testbed_available, tmp_path):
    single = tmp_path / "single.pt"
    done = subprocess.run([sys.executable, str(TRAIN_TINY), "--out", str(single), "--devices", "4", "--strategy",
                           "object", "--shard-group-size", "4"], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    reference = torch.load(single, weights_only=False)

    two = tmp_path / "two_nodes.pt"
    with testbed.two_nodes(rate="1gbit") as bed:
        bed.run(TRAIN_TINY, ["--out", str(two), "--devices", "2", "--num-nodes", "2", "--strategy", "object",
                             "--placement", "contiguous", "--shard-group-size", "2"],
                nproc_per_node=2, timeout=TIMEOUT, log_dir=tmp_path / "logs", cwd=tmp_path).check()
    run = torch.load(two, weights_only=False)
    assert run["shard_groups"] == [[0, 1], [2, 3]] and run["replica_groups"] == [[0, 2], [1, 3]]
    assert run["global_step"] == reference["global_step"] == 8
    assert run["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        torch.testing.assert_close(run["state_dict"][key], value, atol=1e-5, rtol=1e-5, msg=key)
    predicted, expected = _predictions(run["state_dict"]), _predictions(reference["state_dict"])
    torch.testing.assert_close(predicted, expected, atol=1e-5, rtol=1e-5)
    assert (expected - _predictions({})).abs().max() > 1e-3, "training changed the predictions"


def test_failing_node_is_reported_at_once(testbed_available, tmp_path):
    with testbed.two_nodes(rate="1gbit") as bed:
        result = bed.run(testbed.JOBS, ["hold", "--seconds", "600", "--fail-node", "1", "--code", "3"],
                         nproc_per_node=1, timeout=TIMEOUT, log_dir=tmp_path)
        assert all(testbed.namespace_pids(ns) == [] for ns in bed.namespaces), "a process survived the job"
        names = bed.namespaces
    # node 1's torchrun reports its worker's code and exits 1; node 0 is killed for it, not left
    # waiting until the job's timeout (which would kill both and set timed_out)
    assert result.returncodes == [-signal.SIGKILL, 1] and not result.timed_out, result.summary()
    assert "node 1: exiting with code 3" in result.output(1) and re.search(r"exitcode\s*: 3", result.output(1))
    with pytest.raises(testbed.JobFailed, match="node 1 exit code 1"):
        result.check()
    assert not set(names) & set(testbed.namespaces())


def test_namespaces_removed_when_the_body_raises(testbed_available):
    with pytest.raises(RuntimeError, match="body failed"), testbed.two_nodes(rate=None) as bed:
        names = bed.namespaces
        assert set(names) <= set(testbed.namespaces())
        raise RuntimeError("body failed")
    assert not set(names) & set(testbed.namespaces())


def _start_cli_job(tmp_path: Path) -> tuple[subprocess.Popen, list[str]]:
    """The CLI running a job that holds both nodes; returns once both nodes have processes."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "testbed.py"), "--nproc-per-node", "1",
                             "--log-dir", str(tmp_path), "--", str(testbed.JOBS), "hold"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        names = _namespaces_of(proc.pid)
        if len(names) == 2 and all(testbed.namespace_pids(ns) for ns in names):
            return proc, names
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the CLI did not start its job: {proc.communicate(timeout=60)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_removes_namespaces_on_a_signal(testbed_available, tmp_path, sig):
    proc, names = _start_cli_job(tmp_path)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        left = set(names) & set(testbed.namespaces())
    finally:  # whatever happened, leave nothing behind for the next test
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        testbed.remove_stale_namespaces()
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert "namespaces removed" in err
    assert not left, f"{left} outlived the CLI"


def test_next_testbed_removes_what_a_killed_one_left(testbed_available, tmp_path):
    proc, names = _start_cli_job(tmp_path)
    proc.kill()  # SIGKILL: no finally runs; the namespaces and the torchrun agents in them stay
    proc.communicate(timeout=60)
    assert set(names) <= set(testbed.namespaces())
    assert set(testbed.remove_stale_namespaces()) >= set(names)
    assert not set(names) & set(testbed.namespaces())
