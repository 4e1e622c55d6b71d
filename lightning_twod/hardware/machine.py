"""What this rank's machine offers: the memory the planner may count on.

Readings differ between ranks (unequal nodes, MIG slices, container limits), so the strategy
takes the minimum over all ranks before it plans (``consensus.agree_min``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

#: cgroup v2 and v1 files holding a container's memory limit, in the order they are tried.
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def cgroup_memory_limit(files=CGROUP_LIMITS) -> int | None:
    """Bytes of this process's cgroup memory limit, or None when there is none (or it is unreadable).

    ``SC_PHYS_PAGES`` reports the host's memory even inside a container limited to less.
    """
    for path in files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 writes a huge number for "no limit"
            return int(text)
        if text == "max":
            return None
    return None


def host_memory_bytes() -> int:
    """Physical memory of the host, or the cgroup limit when that is lower."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = cgroup_memory_limit()
    return physical if limit is None else min(physical, limit)


def memory_per_rank_bytes(device: torch.device, ranks_per_node: int) -> float:
    """Default memory budget of one rank: its GPU's memory, or the host's share per local rank."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return host_memory_bytes() / max(1, ranks_per_node)
