"""The cross-group reduction's rules that the planner models: which shards go whole, how rows are chunked.

``replication/`` runs the reduction and ``planner/`` predicts its bytes, buffers and seconds; both
read these numbers here, so the model cannot drift from what runs. Pure Python (no torch).
"""

from __future__ import annotations

#: A shard whose touched rows are at least this share of its rows is sent whole, reduced in place
#: (no gather, no index copy). Below it the touched rows are gathered: on the slow links where 2D
#: pays, bytes decide, and sending a whole shard of which 56 % is touched (the Criteo-like
#: workload at interval 8) costs 1.8x the bytes for the copies it saves (benchmarks/results/scaling.md).
#: Sent whole, the pooled workload's shards at interval 8 (83 % touched) would pack and apply in
#: 0.79x the time on a core of their own (``benchmarks/round_cost.py``) for 1.2x the bytes; whether
#: that pays depends on whether the interval hides the larger transfer, which the planner cannot yet
#: tell on CPU ranks, whose base step it under-predicts (``docs/planner.md``).
DENSE_SHARE = 0.9
#: A round's buffer that must grow takes this much more than asked for: rounds vary in size, and one a
#: little larger than the last would otherwise allocate, and fault in page by page, a fresh buffer each time.
GROWTH = 1.25
#: Elements of a whole shard worked on at a time: a chunk of each tensor involved (1 MiB of fp32)
#: stays in the cache from one operation to the next; smaller chunks cost more in calls than
#: they save in memory traffic.
CHUNK = 2**18


def sent_whole(touched_rows: float, rows: int) -> bool:
    """Whether a shard of ``rows`` rows of which ``touched_rows`` were touched is sent whole (``DENSE_SHARE``)."""
    return touched_rows >= DENSE_SHARE * rows


def rows_per_chunk(dim: int) -> int:
    """Rows of a ``[rows, dim]`` piece worked on at a time: ``CHUNK`` elements, at least one row."""
    return max(1, CHUNK // dim)
