#!/usr/bin/env bash
# Creates benchmarks/.venv-torchrec: the project's pinned CPU stack (torch 2.13.0 + fbgemm-gpu-cpu 1.8.0,
# the same pins as requirements/cpu.txt) plus TorchRec 1.8.0 installed WITHOUT its dependencies
# (torchrec 1.8.0 pins torchmetrics==1.0.3, older than the project's 1.9.0), and the few small
# pure-Python packages TorchRec needs at import time, pinned here. Idempotent: does nothing when the
# venv exists with the same pins (stamp file). TORCHREC_VENV overrides the location.
#
#   bash benchmarks/setup_torchrec.sh && benchmarks/.venv-torchrec/bin/python -c "import torchrec"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TORCHREC_VENV:-$ROOT/benchmarks/.venv-torchrec}"
PYTHON="${PYTHON:-python3}"
# Versions read from requirements/cpu.txt, so both environments always run the same kernels.
pin() { grep -E "^$1==" "$ROOT/requirements/cpu.txt" | head -n1; }
TORCH="$(pin torch)"; FBGEMM="$(pin fbgemm-gpu-cpu)"; NUMPY="$(pin numpy)"; TORCHMETRICS="$(pin torchmetrics)"
# TorchRec's import-time dependencies (torchrec/__init__ imports torchrec.distributed, which imports
# tensordict and pyre_extensions; torchrec.metrics is not imported by DMP). Pure Python or small.
EXTRA=(
    "torchrec==1.8.0"
    "tensordict==0.15.3"
    "pyvers==0.2.3"
    "pyre-extensions==0.0.32"
    "typing-inspect==0.9.0"
    "mypy-extensions==1.1.0"
    "typing-extensions==4.15.0"
    "tqdm==4.67.1"
    "iopath==0.1.10"
    "portalocker==3.2.0"
    "cloudpickle==3.1.1"
    "orjson==3.11.3"
    "packaging==25.0"
    "importlib-metadata==8.7.0"
    "zipp==3.23.0"
    "lightning-utilities==0.15.2"
)
stamp="$(printf '%s\n' "$TORCH" "$FBGEMM" "$NUMPY" "$TORCHMETRICS" "${EXTRA[@]}" | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.stamp" 2>/dev/null)" = "$stamp" ]; then
    exit 0
fi
echo "[setup_torchrec] creating $VENV ($TORCH, $FBGEMM, torchrec 1.8.0 --no-deps)" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned, so nothing can pull a multi-GB CUDA build.
"${PIP[@]}" "$TORCH" "$NUMPY"
"${PIP[@]}" --no-deps "$FBGEMM" "$TORCHMETRICS" "${EXTRA[@]}"
"$VENV/bin/python" - <<'PY'
import torch, fbgemm_gpu, torchrec  # noqa: F401  (fails here, with the real error, if the stack is broken)
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
print(f"[setup_torchrec] torch {torch.__version__}, torchrec imports")
PY
echo "$stamp" > "$VENV/.stamp"
