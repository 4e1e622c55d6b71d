"""The links cache: what a set-up or ``lightning-twod calibrate`` measured, kept for the next set-up.

A job of thousands of steps should not bet its layout on a few seconds of probing, and every
set-up on the same cluster should plan on the same numbers. An entry is one YAML file per
``CacheKey`` (the host names of the job, its world size, ranks per node and device), holding the
key, when the links were measured (``measured_at``, seconds since the epoch) and the links
themselves (``LinkModel.to_container``, the repeated probes included, so that the layout choice
predicts every candidate on each of them as it did when they were measured).

* Where: ``$LIGHTNING_TWOD_CACHE/links``, else ``$XDG_CACHE_HOME/lightning-twod/links``, else
  ``~/.cache/lightning-twod/links`` (``cache_dir``). On a cluster, rank 0's host decides: point
  ``LIGHTNING_TWOD_CACHE`` at a shared filesystem to share entries between login and compute nodes.
* Fresh for ``MAX_AGE_S`` (7 days) after the measurement; an older entry, one of other hosts or
  another shape (another file), or one that cannot be read as an entry of its key is a miss, and
  the measurement that follows overwrites it.
* Written atomically (a temporary file in the same folder, then ``os.replace``), read with
  ``yaml.safe_load`` only: nothing in the file can run code.

This module is file I/O only; ``hardware/resolve.py`` gathers the key on the job's ranks and
measures on a miss, ``cli/plan.py`` reads the entry ``fit`` will read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_twod.planner.links import LinkModel

#: Seconds an entry is used after its measurement (7 days).
MAX_AGE_S = 7 * 24 * 3600.0
#: The entries' layout and probe; an entry of another is a miss (and is measured again). 2: the
#: overlap share measured once, from an all-reduce of at least 40 ms (``hardware/probe.py``); the
#: share in an entry of format 1 may read several times what training pays.
FORMAT = 2
#: Environment variable naming the cache's folder (``links/`` in it holds the entries).
CACHE_ENV = "LIGHTNING_TWOD_CACHE"


@dataclass(frozen=True)
class CacheKey:
    """What the links of a job depend on: its hosts (each name once, in rank order), world size,
    ranks per node and device (``"cpu"``, or ``"cuda"`` and the GPU's name)."""

    hosts: tuple[str, ...]
    world_size: int
    ranks_per_node: int
    device: str

    def to_container(self) -> dict[str, Any]:
        return {"hosts": list(self.hosts), "world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "device": self.device}

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.to_container(), sort_keys=True).encode()).hexdigest()[:16]
        return f"links-{digest}.yaml"

    def same_shape(self, other: CacheKey) -> bool:
        """The same world size, ranks per node and device, whatever the hosts."""
        return (self.world_size, self.ranks_per_node, self.device) == (other.world_size, other.ranks_per_node,
                                                                       other.device)

    def describe(self) -> str:
        return (f"{self.world_size} ranks, {self.ranks_per_node} per node, {self.device} on "
                f"{', '.join(self.hosts)}")


@dataclass(frozen=True)
class Lookup:
    """What the cache holds for a key: ``links`` (None on a miss), the entry's ``path``, and ``note``:
    where the links come from (a hit), or why there are none (a miss). ``corrupt``: the file exists
    but is no entry of this key (the caller warns; the next measurement overwrites it)."""

    links: LinkModel | None
    path: Path
    note: str
    corrupt: bool = False
    key: CacheKey | None = None  # the entry's key (a hit)
    measured_at: float = 0.0  # seconds since the epoch (a hit)


def cache_dir() -> Path:
    """The folder of the entries (see the module docstring)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / "links"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "lightning-twod" / "links"


def load(key: CacheKey, directory: Path | None = None, max_age_s: float = MAX_AGE_S,
         now: float | None = None) -> Lookup:
    """The entry of ``key`` where it is fresh (younger than ``max_age_s``), else a miss saying why."""
    path = (directory or cache_dir()) / key.file_name()
    if not path.is_file():
        return Lookup(None, path, f"no entry for {key.describe()} in {path.parent}")
    return _read(path, key, max_age_s, time.time() if now is None else now)


def newest(key: CacheKey, directory: Path | None = None, max_age_s: float = MAX_AGE_S,
           now: float | None = None) -> Lookup:
    """The entry of ``key`` if fresh, else the newest fresh entry of the same shape on other hosts (what
    ``plan`` reads for a job of several nodes, whose hosts it does not know), else a miss."""
    exact = load(key, directory, max_age_s, now)
    if exact.links is not None:
        return exact
    now = time.time() if now is None else now
    folder = directory or cache_dir()
    found = []
    for path in sorted(folder.glob("links-*.yaml")) if folder.is_dir() else []:
        entry = _read(path, None, max_age_s, now)
        if entry.links is not None and entry.key.same_shape(key):
            found.append(entry)
    return max(found, key=lambda entry: entry.measured_at) if found else exact


def save(key: CacheKey, links: LinkModel, directory: Path | None = None, now: float | None = None) -> Path:
    """Write the entry of ``key`` atomically; ``OSError`` where the folder cannot be written."""
    folder = directory or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / key.file_name()
    entry = {"format": FORMAT, "key": key.to_container(), "measured_at": time.time() if now is None else now,
             "links": links.to_container()}
    import yaml

    descriptor, temporary = tempfile.mkstemp(prefix=".links-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(descriptor, "w") as f:
            yaml.safe_dump(entry, f, sort_keys=False)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _read(path: Path, key: CacheKey | None, max_age_s: float, now: float) -> Lookup:
    """The entry in ``path`` (of ``key``, or of any key where None), fresh at ``now``, or why not."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
        old = data.get("format") if isinstance(data, Mapping) else None
        if isinstance(old, int) and not isinstance(old, bool) and 0 < old < FORMAT:
            return Lookup(None, path, f"the links cache entry {path} was measured by an earlier probe (format {old})")
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"not a links cache entry of format {FORMAT}")
        found = _key(data.get("key"))
        if key is not None and found != key:
            raise ValueError(f"it holds the links of {found.describe()}")
        at = data.get("measured_at")
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            raise ValueError(f"measured_at must be a number of seconds, got {at!r}")
        links = LinkModel.from_container(data.get("links"), where=f"links cache entry {str(path)!r}")
    except (OSError, ValueError, yaml.YAMLError) as err:
        return Lookup(None, path, f"the links cache entry {path} cannot be read ({str(err).splitlines()[0]})",
                      corrupt=True)
    age = now - at
    if age < -3600:  # an hour of clock difference between hosts that share the folder is allowed
        return Lookup(None, path, f"the links cache entry {path} is dated in the future")
    age = max(age, 0.0)
    if age > max_age_s:
        return Lookup(None, path, f"the links cache entry {path} was measured {_age(age)} ago, more than "
                                  f"{_age(max_age_s)}")
    note = (f"from the links cache {path}, measured {_age(age)} ago on {found.describe()} (kept "
            f"{_age(max_age_s)}; links='measure' or `lightning-twod calibrate` measures again)")
    return Lookup(replace(links, source=f"{links.source}; {note}"), path, note, key=found, measured_at=float(at))


def _key(data: Any) -> CacheKey:
    if not isinstance(data, Mapping):
        raise ValueError("missing its key")
    hosts, world, rpn, device = (data.get(k) for k in ("hosts", "world_size", "ranks_per_node", "device"))
    if (not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts) or not isinstance(world, int)
            or not isinstance(rpn, int) or not isinstance(device, str)):
        raise ValueError("its key must hold hosts (names), world_size, ranks_per_node (ints) and device")
    return CacheKey(tuple(hosts), world, rpn, device)


def _age(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min"
