"""Two nodes on one machine: two network namespaces joined by one rate-limited veth pair.

Each namespace plays a node. Processes inside one namespace talk over local delivery (like the
GPUs of one node); processes in different namespaces talk over the veth pair, whose two ends are
shaped with a token bucket (``tc ... tbf``) to the given rate in each direction. A job is one
``torch.distributed.run`` launch per namespace (``--nnodes=2``), with ``GLOO_SOCKET_IFNAME`` set to
that namespace's veth end, so gloo's cross-node traffic crosses the shaped link.

As a library (later benchmarks and tests)::

    from benchmarks.testbed import two_nodes
    with two_nodes(rate="1gbit") as bed:            # rate=None: no shaping
        result = bed.run("tests/helpers/scripts/train_tiny.py", ["--out", "x.pt", ...], nproc_per_node=2)
        result.check()                              # raises JobFailed with both logs' tails

As a command (prints both nodes' logs when the job ends; exit code 0 when both nodes succeeded)::

    python benchmarks/testbed.py --rate 1gbit -- tests/helpers/scripts/train_tiny.py --out x.pt ...

Needs root and ``ip``/``tc`` (iproute2). The namespaces, and with them the veth pair, are removed
when the job ends, fails, times out, or the caller gets Ctrl-C (SIGINT), SIGTERM or SIGHUP;
namespaces left behind by a process that was killed outright are removed by the next testbed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).resolve().with_name("testbed_jobs.py")
PREFIX = "twod-"
NAME = re.compile(rf"^{PREFIX}(\d+)-")  # twod-<pid of the creating process>-...
VETHS = ("veth0", "veth1")  # created inside the namespaces, so the names never clash
FIRST_PORT = 29500  # a fresh namespace has no listeners; each job of a testbed takes the next port
# Longest a packet may wait in the bucket's queue (which then holds rate x 50 ms + burst bytes): room
# for TCP's bursts without drops at 1 Mbit/s and up, and too short to mistake for a hang.
TBF_LATENCY = "50ms"
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's units: decimal bits/s
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_sequence = itertools.count()


class TestbedUnavailable(RuntimeError):
    """This machine cannot host the testbed (not root, no iproute2, no network namespaces, no tbf).
    The message says what is missing and how to fix it, in one line."""


class JobFailed(RuntimeError):
    """A job on the testbed failed or timed out; the message holds both nodes' exit codes and logs."""


class _CommandFailed(RuntimeError):
    pass


def parse_rate(rate: str | int | None) -> int | None:
    """Bits per second of ``"200mbit"``, ``"1gbit"``, ``"500kbit"``, ``"1e9"`` or an int; ``None``,
    ``"unshaped"`` or ``"none"``: no shaping (``None``). Units are tc's: decimal bits per second."""
    if rate is None or isinstance(rate, int):
        return rate
    text = rate.strip().lower()
    if text in ("unshaped", "none"):
        return None
    match = re.fullmatch(r"([0-9.e+]+)\s*([a-z]*)", text)
    if not match or match.group(2) not in ("", *_RATE_UNITS):
        raise ValueError(f"rate {rate!r}: give a number of bits per second with an optional unit "
                         f"{'/'.join(_RATE_UNITS)} (e.g. 200mbit, 1gbit), or 'unshaped'")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2) or "bit"]
    if bits < 8_000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s; the testbed is meant for 1 Mbit/s and up")
    return int(bits)


def format_rate(bits: int | None) -> str:
    """``1 Gbit/s``, ``200 Mbit/s``, or ``unshaped``."""
    if bits is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits} bit/s"


def tbf_burst(bits: int) -> int:
    """Bucket size in bytes for a tbf of ``bits`` per second.

    At least 10 ms of traffic (rate / 100): the kernel refills the bucket once per timer tick,
    and a bucket smaller than one tick's tokens (HZ = 100 at worst) caps the rate below the one
    asked for. At least 64 KiB: veth hands the qdisc GSO packets of up to 64 KiB, which then pass
    whole instead of being split. No larger: the first burst bytes of a transfer go at memory
    speed, so a big bucket would make short transfers look faster than the link (here 10 ms of
    traffic, e.g. 1.5 % of a 16 MiB transfer at 200 Mbit/s).
    """
    return max(bits // 8 // 100, 64 * 1024)


def _command(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise _CommandFailed(f"`{' '.join(argv)}` failed: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done.stdout


def preflight() -> None:
    """Raises :class:`TestbedUnavailable` unless this is Linux, we are root, ``ip`` and ``tc`` are
    on PATH and ``ip netns add`` works (a namespace is created and deleted to find out)."""
    if sys.platform != "linux":
        raise TestbedUnavailable(f"the two-node testbed needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise TestbedUnavailable("the two-node testbed needs root to create network namespaces: run it as root "
                                 "(e.g. sudo .venv/bin/python benchmarks/testbed.py ...)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(f"the two-node testbed needs `{tool}` on PATH: install iproute2 "
                                     "(apt-get install iproute2)")
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _command("ip", "netns", "add", probe)
    except _CommandFailed as error:
        raise TestbedUnavailable(f"network namespaces do not work here ({error}); the testbed needs "
                                 "CAP_SYS_ADMIN and a kernel with CONFIG_NET_NS, e.g. a VM or a privileged "
                                 "container") from None
    _remove_namespace(probe)


def namespaces() -> list[str]:
    """Names of all network namespaces of this machine."""
    return [line.split()[0] for line in _command("ip", "netns", "list").splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Processes inside network namespace ``namespace`` (none when it does not exist)."""
    try:
        return [int(pid) for pid in _command("ip", "netns", "pids", namespace).split()]
    except _CommandFailed:
        return []


def _kill_namespace(namespace: str) -> None:
    """SIGKILLs every process in ``namespace``: only the testbed ever enters it. torchrun starts
    its workers in sessions of their own, so killing the agent's process group would miss them."""
    for _ in range(10):
        pids = namespace_pids(namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove_namespace(namespace: str) -> None:
    _kill_namespace(namespace)
    try:
        _command("ip", "netns", "del", namespace)
    except _CommandFailed as err:
        if namespace in namespaces():
            raise RuntimeError(f"could not remove network namespace {namespace}: run `ip netns del {namespace}`") from err


def remove_stale_namespaces() -> list[str]:
    """Removes testbed namespaces whose creating process no longer exists (it was SIGKILLed);
    returns their names."""
    stale = []
    for name in namespaces():
        match = NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _remove_namespace(name)
            stale.append(name)
    return stale


@dataclass
class JobResult:
    """Exit codes (negative: killed by that signal), log files and wall time of one job."""

    returncodes: list[int]
    logs: list[Path]
    elapsed_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncodes == [0, 0] and not self.timed_out

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def summary(self) -> str:
        codes = ", ".join(f"node {node} exit code {code}" for node, code in enumerate(self.returncodes))
        return f"{codes} after {self.elapsed_s:.1f} s" + (" (timed out)" if self.timed_out else "")

    def check(self, tail: int = 5000) -> JobResult:
        """Returns self when both nodes succeeded, else raises :class:`JobFailed` with the logs' tails."""
        if not self.ok:
            logs = "\n".join(f"--- node {node} ({log}):\n{self.output(node)[-tail:]}"
                             for node, log in enumerate(self.logs))
            raise JobFailed(f"the two-node job failed: {self.summary()}\n{logs}")
        return self


class TwoNodes:
    """The testbed while it exists (made by :func:`two_nodes`): namespace names, veth names and
    addresses of node 0 and node 1, and :meth:`run` to launch a job on both."""

    def __init__(self, rate: str | int | None) -> None:
        self.rate = parse_rate(rate)
        run = f"{PREFIX}{os.getpid()}-{next(_sequence)}"
        self.namespaces = (f"{run}-0", f"{run}-1")
        self.veths = VETHS
        subnet = f"10.213.{os.getpid() % 256}"  # a /30 that exists only inside the two namespaces
        self.addresses = (f"{subnet}.1", f"{subnet}.2")
        self._ports = itertools.count(FIRST_PORT)

    def __repr__(self) -> str:
        nodes = " <-> ".join(f"{ns} ({addr} on {veth})"
                             for ns, addr, veth in zip(self.namespaces, self.addresses, self.veths))
        return f"TwoNodes({nodes}, {format_rate(self.rate)})"

    def _create(self) -> None:
        (ns0, ns1), (veth0, veth1) = self.namespaces, self.veths
        for ns in self.namespaces:
            _command("ip", "netns", "add", ns)
        _command("ip", "link", "add", veth0, "netns", ns0, "type", "veth", "peer", "name", veth1, "netns", ns1)
        for ns, veth, address in zip(self.namespaces, self.veths, self.addresses):
            _command("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", veth)
            _command("ip", "-n", ns, "link", "set", "lo", "up")
            _command("ip", "-n", ns, "link", "set", veth, "up")
            if self.rate is not None:  # each end shapes what leaves it: both directions at the rate
                _command("tc", "-n", ns, "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{self.rate}bit",
                         "burst", str(tbf_burst(self.rate)), "latency", TBF_LATENCY)

    def _remove(self) -> None:
        for ns in self.namespaces:
            _remove_namespace(ns)

    def run(self, script: str | os.PathLike, args: Sequence[str] = (), nproc_per_node: int = 2,
            timeout: float = 600, log_dir: str | os.PathLike | None = None, cwd: str | os.PathLike | None = None,
            env: dict[str, str] | None = None) -> JobResult:
        """Runs ``script args`` under torchrun on both nodes and waits for both.

        When one node exits with an error, the other is killed at once (torchrun would otherwise
        wait for it in rendezvous or its exit barrier for minutes); after ``timeout`` seconds both
        are. Logs (stdout and stderr of each node's agent and workers) go to ``log_dir``/node<K>.log
        (default: a new temporary directory, kept). ``env`` is added to this process's environment.
        """
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="twod-cluster-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        script, port = Path(script).resolve(), next(self._ports)
        logs = [log_dir / f"node{node}.log" for node in (0, 1)]
        sinks = [log.open("w") for log in logs]
        procs: list[subprocess.Popen] = []
        start = time.monotonic()
        timed_out = False
        try:
            for node, (ns, veth) in enumerate(zip(self.namespaces, self.veths)):
                node_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": veth, "OMP_NUM_THREADS": "1",
                            "PYTHONUNBUFFERED": "1"}
                node_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), node_env.get("PYTHONPATH")) if p)
                argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                        f"--nproc-per-node={nproc_per_node}", f"--node-rank={node}",
                        f"--master-addr={self.addresses[0]}", f"--master-port={port}", str(script), *map(str, args)]
                procs.append(subprocess.Popen(argv, cwd=cwd, env=node_env, stdout=sinks[node],
                                              stderr=subprocess.STDOUT, start_new_session=True))
            while True:
                codes = [proc.poll() for proc in procs]
                if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes):
                    break
                if time.monotonic() - start > timeout:
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            for ns in self.namespaces:  # the survivor of a failure, or both after a timeout or a signal
                _kill_namespace(ns)
            for proc in procs:
                proc.wait()
            for sink in sinks:
                sink.close()
        return JobResult([proc.returncode for proc in procs], logs, time.monotonic() - start, timed_out)


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit (as SIGINT raises KeyboardInterrupt), so that the
    testbed's ``finally`` runs; only where they would otherwise kill the process outright."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    for sig, handler in previous.items():
        if handler is signal.SIG_DFL:
            signal.signal(sig, raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """Holds back SIGINT, SIGTERM and SIGHUP (they arrive afterwards) so that removal runs to the end."""
    held = {signal.SIGINT, *_HANDLED_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def two_nodes(rate: str | int | None = "1gbit") -> Iterator[TwoNodes]:
    """Creates the testbed, yields it, and always removes it (also on an exception, SIGINT,
    SIGTERM or SIGHUP). ``rate``: the link's rate in each direction (see :func:`parse_rate`);
    ``None`` or ``"unshaped"``: no qdisc. Raises :class:`TestbedUnavailable` when this machine
    cannot host it."""
    bed = TwoNodes(rate)
    preflight()
    remove_stale_namespaces()
    with _signals_raise():
        try:
            try:
                bed._create()
            except _CommandFailed as error:
                raise TestbedUnavailable(f"could not build the testbed: {error}") from None
            yield bed
        finally:
            with _signals_blocked():
                bed._remove()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [--rate RATE] [options] -- SCRIPT [ARGS ...]")
    parser.add_argument("--rate", default="1gbit", help="rate of the link in each direction: 200mbit, 1gbit, ... "
                                                        "or 'unshaped' (default 1gbit)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="processes per node (default 2)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before both nodes are killed")
    parser.add_argument("--log-dir", help="where node0.log and node1.log go (default: a new temporary directory)")
    split = argv.index("--") if "--" in argv else len(argv)
    options, job = parser.parse_args(argv[:split]), argv[split + 1:]
    if not job:
        parser.error("give the job after `--`: cluster.py [options] -- SCRIPT [ARGS ...]")
    try:
        parse_rate(options.rate)
    except ValueError as error:
        parser.error(str(error))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with two_nodes(options.rate) as bed:
            print(f"cluster.py: {bed}", flush=True)
            result = bed.run(job[0], job[1:], nproc_per_node=options.nproc_per_node, timeout=options.timeout,
                             log_dir=options.log_dir)
    except TestbedUnavailable as error:
        print(f"cluster.py: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit) as stop:
        print("cluster.py: stopped by a signal; the job was killed and the namespaces removed", file=sys.stderr)
        return 130 if isinstance(stop, KeyboardInterrupt) else stop.code
    for node in (0, 1):
        print(f"--- node {node} ({result.logs[node]}):\n{result.output(node)}", end="", flush=True)
    print(f"cluster.py: {result.summary()}")
    if result.ok:
        return 0
    return 124 if result.timed_out else next((code for code in result.returncodes if code > 0), 1)


if __name__ == "__main__":
    sys.exit(main())
