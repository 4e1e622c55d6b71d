"""Every test keeps the links it measures out of the user's links cache (``planner/link_cache.py``).

A set-up with ``links="auto"`` reads and writes the cache named by ``LIGHTNING_TWOD_CACHE``: each test
gets a folder of its own (what it runs in this process and in the processes it starts with
``subprocess``), and the session one more, set before any test, for the processes of
``run_distributed``'s forkserver, which keep the environment the forkserver started with.
"""

from __future__ import annotations

import pytest

from lightning_twod.planner.link_cache import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def links_cache_of_the_session(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("links-cache-session")))
        yield


@pytest.fixture(autouse=True)
def links_cache(tmp_path_factory, monkeypatch):
    """This test's links cache folder (the entries are under ``links/`` in it)."""
    folder = tmp_path_factory.mktemp("links-cache")
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder
