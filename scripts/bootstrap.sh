# Sourced by run.sh and test.sh: creates ./.venv with the pinned CPU stack when it is missing or
# when requirements/cpu.txt, movielens.txt, torchrec.txt or pyproject.toml changed since it was made,
# then activates it.
# TWOD_VENV overrides the location.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TWOD_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$(cat "$ROOT/requirements/cpu.txt" "$ROOT/requirements/movielens.txt" "$ROOT/requirements/torchrec.txt" \
    "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.twod-stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "[set-up] creating $VENV with the pinned CPU stack (requirements/cpu.txt)" >&2
    "$PYTHON" -m venv "$VENV"
    # torch==2.13.0 is pinned first so that nothing can pull a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/requirements/cpu.txt"
    # MovieLens-100K data only: the recbole wheel ships it; its dependencies are not wanted.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$ROOT/requirements/movielens.txt"
    # TorchRec for the interop tests, without its CUDA FBGEMM and old torchmetrics pins.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$ROOT/requirements/torchrec.txt"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
    echo "$stamp" > "$VENV/.twod-stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
