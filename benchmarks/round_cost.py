"""What one overlapped round costs on a CPU core of its own: packing and applying, nothing else running.

The headline's rounds (``overlap.py``) run on 4 ranks sharing 2 cores, beside the training and
gloo's threads, so their ``part_pack`` and ``part_apply`` include waiting for a core and for memory.
This times the same round (``replication.rounds.OverlappedRound``, the bf16 wire, the row-wise
AdaGrad state) on one process and one thread, over the shards one rank of ``2x2c`` holds of each
workload of ``scaling.py`` (half of the tables' rows), with the share of rows a round sends there
at interval 8 (Criteo-like 56 %, pooled 83 %: the sittings' rows per round), and pooled once more
with its shards sent whole (what ``core.reduction.DENSE_SHARE`` at 0.8 would do); the rows are
drawn uniformly (SYNTHETIC). Interleaved rounds; prints, and writes to ``OUT/round_cost.md``, the median
of each part and its nanoseconds per element sent.

    python benchmarks/round_cost.py [--rounds 7] [--out-dir benchmarks/results/overlap]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import scaling  # noqa: E402

from lightning_twod.core.reduction import sent_whole  # noqa: E402
from lightning_twod.replication.rounds import OverlappedRound, Segment, Workspace  # noqa: E402

#: (workload, share of a shard's rows a round sends at interval 8, whether shards go whole whatever the share)
CASES = [("criteo", 0.56, False), ("pooled", 0.83, False), ("pooled", 0.83, True)]


class Shards:
    """One rank's half of a workload's tables: weights ``[R, D]``, row-wise state ``[R, 1]``, their
    references, and the rows a round sends (None: the shard goes whole)."""

    def __init__(self, workload: str, share: float, whole: bool = False, seed: int = 0) -> None:
        work = scaling.WORKLOADS[workload]
        gen = torch.Generator().manual_seed(seed)
        tables, rows = work.num_tables // 2, work.rows
        self.weights = [torch.randn(rows, work.dim, generator=gen) for _ in range(tables)]
        self.states = [torch.rand(rows, 1, generator=gen) for _ in range(tables)]
        self.references = [(w.clone(), s.clone()) for w, s in zip(self.weights, self.states, strict=True)]
        whole = whole or sent_whole(share * rows, rows)
        self.rows = [None if whole else torch.randperm(rows, generator=gen)[:int(share * rows)].sort().values
                     for _ in range(tables)]
        self.whole = whole
        self.elements = sum((rows if r is None else r.numel()) * (work.dim + 1) for r in self.rows)

    def segments(self) -> list[Segment]:
        return [Segment([w, s], list(ref), rows) for w, s, ref, rows
                in zip(self.weights, self.states, self.references, self.rows, strict=True)]

    def train(self) -> None:
        """What the copies' steps changed since the last round (every row: the cost does not depend on it)."""
        for w in self.weights:
            w.add_(1e-3)


def time_round(shards: Shards, workspace: Workspace) -> tuple[float, float]:
    """Seconds to pack (launch) and to apply one round over a group of one."""
    shards.train()
    start = time.perf_counter()
    flight = OverlappedRound(shards.segments(), dist.group.WORLD, 1, "bf16", workspace)
    packed = time.perf_counter()
    flight.finite()
    waited = time.perf_counter()
    flight.finish()
    return packed - start, time.perf_counter() - waited


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results" / "overlap")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cases = [(name, share, Shards(name, share, whole), Workspace(torch.device("cpu"))) for name, share, whole in CASES]
    times = [[] for _ in cases]
    for _ in range(args.rounds + 1):  # the first round of each grows the buffers: not counted
        for case, (_, _, shards, workspace) in enumerate(cases):
            times[case].append(time_round(shards, workspace))
    lines = ["# One overlapped bf16 round on a core of its own (`benchmarks/round_cost.py`)", "",
             f"Median of {args.rounds} rounds, one thread, load average {os.getloadavg()[0]:.2f} at the end.", "",
             "| workload | sent | elements | pack ms | apply ms | ns per element (pack + apply) |",
             "|---|---|---:|---:|---:|---:|"]
    for (name, share, shards, _), timed in zip(cases, times, strict=True):
        pack = statistics.median(t[0] for t in timed[1:]) * 1e3
        apply = statistics.median(t[1] for t in timed[1:]) * 1e3
        sent = f"{share:.0%} of rows, " + ("shards sent whole" if shards.whole else "gathered")
        lines.append(f"| {name} | {sent} | {shards.elements / 1e6:.1f} M | {pack:.1f} | {apply:.1f} | "
                     f"{(pack + apply) * 1e6 / shards.elements:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "round_cost.md").write_text(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
