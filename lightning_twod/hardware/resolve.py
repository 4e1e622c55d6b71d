"""The strategy's ``links=``: what a value means, and the links a plan is made on.

``"auto"`` (where the layout is chosen by cost) reads the links cache (``planner/link_cache.py``)
and measures at set-up (``probe.measure``) only where it holds no fresh entry for this job's hosts
and shape; ``"measure"`` always measures. Both keep what they measured in the cache, as
``lightning-twod calibrate`` does (``remember``). Rank 0 reads and writes the cache and sends what
it decided to every rank, so every rank plans on the same numbers. A preset name or a
``LinkModel`` is taken as it is, and any other string is a YAML file of ``lightning-twod
calibrate``, read when the strategy is made. Where nothing is measured (a pinned layout, one
process), the partition is balanced on ``UNMEASURED_DEFAULT``'s numbers.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_twod.hardware.probe import measure
from lightning_twod.planner import link_cache
from lightning_twod.planner.link_cache import CacheKey
from lightning_twod.planner.links import PRESETS, LinkModel

#: ``links=`` values that measure at set-up: ``"auto"`` when the layout is chosen by cost, ``"measure"`` always.
MEASURED = ("auto", "measure")
#: Links the partitioner balances on when nothing is measured (the layout is pinned, or one process).
UNMEASURED_DEFAULT = "h100"


def unmeasured_links(device: torch.device) -> LinkModel:
    """What a plan balances on when nothing is measured: the ``UNMEASURED_DEFAULT`` preset on a GPU;
    on a CPU its numbers, not named as a GPU's (they are no prediction of this machine)."""
    preset = PRESETS[UNMEASURED_DEFAULT]
    if device.type == "cuda":
        return preset
    return replace(preset, name="unmeasured", source="nothing measured (pinned layout or one process): nominal "
                                                     "numbers for balancing the partition, not this CPU's")


def configured_links(value, owner: str = "links") -> LinkModel | str:
    """A strategy's ``links=``: ``"auto"``, ``"measure"``, a preset name, a YAML path (read now: a
    missing, unreadable or incomplete file raises ``ValueError`` naming it and the field) or a
    ``LinkModel``."""
    if isinstance(value, LinkModel) or value in MEASURED:
        return value
    if isinstance(value, str) and value in PRESETS:
        return PRESETS[value]
    if isinstance(value, (str, os.PathLike)):
        return LinkModel.load(value)
    raise ValueError(f"{owner}: links={value!r}; use 'auto', 'measure', a preset ({', '.join(sorted(PRESETS))}), "
                     "a file written by `python -m lightning_twod calibrate`, or a LinkModel")


def planning_links(configured: LinkModel | str, group, ranks_per_node: int, device: torch.device,
                   chosen_by_cost: bool) -> LinkModel:
    """The links a strategy plans with (a collective of every rank of ``group``): the configured ones;
    for ``"auto"`` when the layout is chosen by cost, the links cache's entry for this job, else
    measured now and kept there; for ``"measure"``, measured now and kept. Without a process group
    (one process) nothing is measured."""
    if isinstance(configured, LinkModel):
        return configured
    if group is None or dist.get_world_size(group) < 2 or (configured == "auto" and not chosen_by_cost):
        return unmeasured_links(device)
    key = job_key(group, ranks_per_node, device)
    cached = ""
    if dist.get_rank(group) == 0 and configured == "auto":
        try:
            found = link_cache.load(key)
        except (OSError, RuntimeError) as err:  # no home folder, a folder that cannot be listed
            found = link_cache.Lookup(None, Path(), f"the links cache cannot be read ({err})", corrupt=True)
        if found.corrupt:
            warnings.warn(f"{found.note}: measuring the links again, and keeping them there", stacklevel=2)
        cached = json.dumps(found.links.to_container()) if found.links is not None else ""
    cached = _from_rank_0(cached, group)
    if cached:
        return LinkModel.from_container(json.loads(cached), where="the links cache")
    return remember(measure(ranks_per_node, device, group), key, group)


def remember(links: LinkModel, key: CacheKey, group) -> LinkModel:
    """Keep ``links`` (measured on every rank of ``group``, whose ``key`` it is) in the links cache (rank 0
    writes; a folder that cannot be written is warned about) and return, on every rank, the numbers as
    the cache holds them, so that this set-up plans on what the next one reads."""
    text = ""
    if dist.get_rank(group) == 0:
        try:
            where = f"kept in the links cache {link_cache.save(key, links)} for {link_cache.MAX_AGE_S / 86400:g} days"
        except (OSError, RuntimeError) as err:  # a folder that cannot be written, no home folder
            where = f"not kept: the links cache cannot be written ({err})"
            warnings.warn(f"{where}; set ${link_cache.CACHE_ENV} to a folder that can be", stacklevel=2)
        text = json.dumps(replace(links, source=f"{links.source}; {where}").to_container())
    return LinkModel.from_container(json.loads(_from_rank_0(text, group)), where="the links measured")


def job_key(group, ranks_per_node: int, device: torch.device) -> CacheKey:
    """The cache key of the job of ``group`` (a collective: every rank's host name)."""
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return CacheKey(tuple(dict.fromkeys(hosts)), len(hosts), ranks_per_node, device_name(device))


def device_name(device: torch.device) -> str:
    """``"cpu"``, or ``"cuda"`` and the GPU's name: what the links of a cache entry were measured on."""
    return f"cuda {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def _from_rank_0(text: str, group) -> str:
    """Rank 0's ``text`` on every rank of ``group``."""
    box = [text]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def measures(configured: LinkModel | str, chosen_by_cost: bool) -> bool:
    """Whether a fit with ``links=configured`` measures at set-up (on two ranks or more)."""
    return configured == "measure" or (configured == "auto" and chosen_by_cost)
