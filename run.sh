#!/usr/bin/env bash
# The main job (creates ./.venv first if needed). Extra arguments go to the job.
source "$(dirname "$0")/scripts/bootstrap.sh"
exec python -m lightning_twod demo "$@"
