"""The links cache on one process: an entry is found for its hosts and shape while fresh, missed for
other hosts, another shape, an old entry or a file that is no entry (which the next save overwrites),
and written atomically. Set-ups that read it on real processes: ``tests/system/test_planner_links.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from lightning_twod.planner import CollectiveCost, LinkModel
from lightning_twod.planner import link_cache as cache
from lightning_twod.planner.link_cache import CacheKey
from lightning_twod.planner.links import fastest_of

KEY = CacheKey(("node-a", "node-b"), 4, 2, "cpu")
NOW = 1_800_000_000.0
DAY = 86400.0


def _links(k: float = 1.0) -> LinkModel:
    return LinkModel(CollectiveCost(1.2e9 * k, 600e-6), CollectiveCost(0.06e9 * k, 1.1e-3),
                     CollectiveCost(1.25e9 * k, 800e-6), CollectiveCost(0.062e9 * k, 900e-6), 13e9, 40e9, 55e9, 2,
                     overlap_share=0.8, name="measured", source="three probes")


def _numbers(links: LinkModel | None) -> LinkModel | None:
    """``links`` without the note on where they come from."""
    return None if links is None else replace(links, source="")


def _probed() -> LinkModel:
    return fastest_of([_links(0.5), _links(1.0), _links(0.8)], "measured", "three probes")


def test_an_entry_is_found_for_its_hosts_and_shape_with_its_probes(tmp_path):
    path = cache.save(KEY, _probed(), tmp_path, now=NOW)
    found = cache.load(KEY, tmp_path, now=NOW + 3600)
    assert _numbers(found.links) == _numbers(_probed()) and found.path == path and not found.corrupt
    assert [s.all_to_all_inter for s in found.links.samples] == [s.all_to_all_inter for s in _probed().samples]
    # the layout choice sees the probes it saw at measurement
    assert [replace(s, name="", source="") for s in found.links.samples] == [replace(s, name="", source="")
                                                                           for s in _probed().samples]
    assert "from the links cache" in found.links.source and "measured 1.0 h ago on 4 ranks, 2 per node" in found.note
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it


@pytest.mark.parametrize("other", [CacheKey(("node-a", "node-c"), 4, 2, "cpu"), CacheKey(("node-a", "node-b"), 8, 4, "cpu"),
                                   CacheKey(("node-a", "node-b"), 4, 2, "cuda NVIDIA H100 80GB HBM3")])
def test_other_hosts_or_another_shape_miss(tmp_path, other):
    cache.save(KEY, _links(), tmp_path, now=NOW)
    missed = cache.load(other, tmp_path, now=NOW)
    assert missed.links is None and not missed.corrupt and "no entry for" in missed.note


def test_an_entry_older_than_its_age_misses_and_a_new_measurement_replaces_it(tmp_path):
    cache.save(KEY, _links(0.5), tmp_path, now=NOW)
    assert _numbers(cache.load(KEY, tmp_path, now=NOW + 6.9 * DAY).links) == _numbers(_links(0.5))
    stale = cache.load(KEY, tmp_path, now=NOW + 7.1 * DAY)
    assert stale.links is None and not stale.corrupt and "measured 7.1 days ago, more than 7.0 days" in stale.note
    assert cache.load(KEY, tmp_path, max_age_s=3600, now=NOW + 7200).links is None  # a shorter age, asked for
    cache.save(KEY, _links(), tmp_path, now=NOW + 7.1 * DAY)
    assert _numbers(cache.load(KEY, tmp_path, now=NOW + 7.2 * DAY).links) == _numbers(_links())


@pytest.mark.parametrize("text, why", [
    ("links: [unclosed\n", "cannot be read"),
    ("- a list\n", "not a links cache entry"),
    ("!!python/object/apply:os.system ['echo pwned']\n", "cannot be read"),  # never constructed
    (None, "it holds the links of 8 ranks"),  # another key's entry under this key's name
    ("format: 2\nkey: {hosts: [node-a, node-b], world_size: 4, ranks_per_node: 2, device: cpu}\n"
     "measured_at: 1800000000.0\nlinks: {name: x}\n", "missing field all_to_all"),
    ("format: 2\nkey: {hosts: [node-a, node-b], world_size: 4, ranks_per_node: 2, device: cpu}\n"
     "measured_at: yesterday\n", "measured_at must be a number"),
])
def test_a_file_that_is_no_entry_of_its_key_misses_as_corrupt_and_is_overwritten(tmp_path, text, why):
    path = tmp_path / KEY.file_name()
    if text is None:
        cache.save(CacheKey(("node-a", "node-b"), 8, 4, "cpu"), _links(), tmp_path, now=NOW)
        (tmp_path / CacheKey(("node-a", "node-b"), 8, 4, "cpu").file_name()).rename(path)
    else:
        path.write_text(text)
    broken = cache.load(KEY, tmp_path, now=NOW)
    assert broken.links is None and broken.corrupt and why in broken.note and str(path) in broken.note
    cache.save(KEY, _links(), tmp_path, now=NOW)
    assert _numbers(cache.load(KEY, tmp_path, now=NOW).links) == _numbers(_links())


def test_an_entry_of_an_earlier_probe_misses_without_a_warning_and_is_measured_again(tmp_path):
    cache.save(KEY, _links(), tmp_path, now=NOW)
    path = tmp_path / KEY.file_name()
    path.write_text(path.read_text().replace(f"format: {cache.FORMAT}", "format: 1"))
    old = cache.load(KEY, tmp_path, now=NOW)
    assert old.links is None and not old.corrupt and "earlier probe (format 1)" in old.note
    cache.save(KEY, _links(), tmp_path, now=NOW)
    assert _numbers(cache.load(KEY, tmp_path, now=NOW).links) == _numbers(_links())


def test_plan_finds_the_newest_entry_of_the_same_shape_where_it_does_not_know_the_hosts(tmp_path):
    cache.save(CacheKey(("old-a", "old-b"), 4, 2, "cpu"), _links(0.5), tmp_path, now=NOW)
    cache.save(CacheKey(("new-a", "new-b"), 4, 2, "cpu"), _links(0.8), tmp_path, now=NOW + 60)
    cache.save(CacheKey(("new-a", "new-b"), 8, 4, "cpu"), _links(), tmp_path, now=NOW + 120)
    (tmp_path / "links-0000000000000000.yaml").write_text("links: [unclosed\n")  # skipped
    here = CacheKey(("login",), 4, 2, "cpu")
    found = cache.newest(here, tmp_path, now=NOW + 180)
    assert _numbers(found.links) == _numbers(_links(0.8)) and found.key.hosts == ("new-a", "new-b")
    assert cache.newest(CacheKey(("login",), 2, 2, "cpu"), tmp_path, now=NOW).links is None


def test_the_folder_is_named_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine" / "links"
    monkeypatch.delenv(cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "lightning-twod" / "links"
    saved = yaml.safe_load(cache.save(KEY, _links(), now=NOW).read_text())
    assert saved["key"] == KEY.to_container() and saved["measured_at"] == NOW and saved["format"] == cache.FORMAT
