#!/usr/bin/env bash
# The main job (creates ./.venv first if needed): DLRM on MovieLens-100K, 2x2 mesh on 4 CPU
# processes, through LightningCLI. Extra arguments go to the CLI, e.g. ./run.sh --trainer.max_epochs=1
# (`python -m lightning_twod demo` is the short synthetic demo of the strategy).
source "$(dirname "$0")/scripts/bootstrap.sh"
exec python -m lightning_twod fit --config examples/configs/movielens_2x2.yaml "$@"
