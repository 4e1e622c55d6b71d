#!/usr/bin/env bash
# Runs the test suite (creates ./.venv first if needed). Extra arguments go to pytest.
source "$(dirname "$0")/scripts/bootstrap.sh"
exec python -m pytest "$@"
