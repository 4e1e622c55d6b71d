"""The strategy's ``links=``: what a value means, and the links a plan is made on.

``"auto"`` and ``"measure"`` measure at set-up (``probe.measure``; ``"auto"`` only where the layout is
chosen by cost), a preset name or a ``LinkModel`` is taken as it is, and any other string is a YAML
file of ``lightning-twod calibrate``, read when the strategy is made. Where nothing is measured
(a pinned layout, one process), the partition is balanced on ``UNMEASURED_DEFAULT``'s numbers.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from lightning_twod.hardware.probe import measure
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
    """The links a strategy plans with: the configured ones, or measured now (a collective of every
    rank of ``group``) for ``"measure"``, and for ``"auto"`` when the layout is chosen by cost.
    Without a process group (one process) nothing is measured."""
    if isinstance(configured, LinkModel):
        return configured
    if group is None or dist.get_world_size(group) < 2 or (configured == "auto" and not chosen_by_cost):
        return unmeasured_links(device)
    return measure(ranks_per_node, device, group)


def measures(configured: LinkModel | str, chosen_by_cost: bool) -> bool:
    """Whether a fit with ``links=configured`` measures at set-up (on two ranks or more)."""
    return configured == "measure" or (configured == "auto" and chosen_by_cost)
