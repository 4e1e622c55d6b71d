"""The fast tier: tests that start no process (``./test.sh tests/unit``); ``conftest.py`` enforces it."""
