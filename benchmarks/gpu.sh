#!/usr/bin/env bash
# GPU checks and benchmark for a machine with one NVIDIA GPU, no network, and its own preinstalled
# PyTorch (2.11-2.14 with CUDA), Lightning and torchmetrics. FBGEMM's CUDA wheel is not expected:
# the package runs on its pure torch kernels there. Small pure-Python wheels it lacks (omegaconf,
# jsonargparse, pytest, ...) are installed offline from $WHEELS (default ./.whl) when present.
#
#   bash benchmarks/gpu.sh                # results in $OUT (default ./gpu-results)
#   GPU_QUICK=1 bash benchmarks/gpu.sh    # smaller benchmark sizes (a few seconds)
#   GPU_DRY=1 bash benchmarks/gpu.sh      # no GPU needed: every step, the benchmark tiny on CPU
#
# Steps, each logged to $OUT: environment (nvidia-smi, versions), the CUDA tests (tests/system/test_cuda.py:
# 2 processes share the GPU over gloo; NCCL would need one GPU per rank), then the lookup + update
# bandwidth benchmark (benchmarks/gpu_bandwidth.py) with and without input checks. A failing step
# does not stop the later ones; the exit status is that of the first failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
OUT="${OUT:-$ROOT/gpu-results}"
WHEELS="${WHEELS:-$ROOT/.whl}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
status=0
step() {  # step NAME COMMAND...: run, tee to $OUT/NAME.log, remember the first failure
    local name="$1"; shift
    echo "=== $name: $*" | tee "$OUT/$name.log"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

# 1. environment
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi || echo "nvidia-smi not found"
    "$PY" - <<'PY'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", "count", torch.cuda.device_count())
for name in ("lightning", "torchmetrics", "omegaconf", "jsonargparse", "pytest", "fbgemm_gpu"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as err:  # a missing or mismatched package is a finding, not a crash here
        print(name, "MISSING:", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
PY
} 2>&1 | tee "$OUT/environment.txt"

# 2. missing small pure-Python dependencies, offline, from $WHEELS
missing=()
for mod in omegaconf jsonargparse pytest; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ -d "$WHEELS" ]; then
        step install "$PY" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}"
    else
        echo "missing ${missing[*]} and no wheel folder $WHEELS: continuing without them" | tee "$OUT/install.log"
    fi
fi
step import "$PY" -c "import lightning_twod, torch; from lightning_twod.sparse.kernels import fbgemm_available; print('lightning_twod imports on torch', torch.__version__, '; fbgemm', fbgemm_available())"

# 3. the CUDA tests (they skip themselves without a GPU; a plain runner when pytest is missing)
if "$PY" -c "import pytest" 2>/dev/null; then
    step cuda_tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/system/test_cuda.py
else
    step cuda_tests "$PY" tests/system/test_cuda.py
fi

# 4. lookup + update bandwidth of the sharded collection (torch backend) vs raw torch and a copy
if [ -n "${GPU_DRY:-}" ]; then
    SIZES=(--dry)  # tiny CPU run: checks that the script works, no numbers
elif [ -n "${GPU_QUICK:-}" ]; then
    SIZES=(--rows 200000 --batch 4096 --iters 10)
else
    SIZES=()
fi
step bandwidth "$PY" benchmarks/gpu_bandwidth.py --out "$OUT" "${SIZES[@]}"
cp "$OUT/gpu_bandwidth.json" "$OUT/gpu_bandwidth_checked.json" 2>/dev/null
step bandwidth_nocheck "$PY" benchmarks/gpu_bandwidth.py --out "$OUT/nocheck" --no-check --variants ours "${SIZES[@]}"
if "$PY" -c "from lightning_twod.sparse.kernels import fbgemm_available as f; raise SystemExit(0 if f() else 1)" 2>/dev/null; then
    step bandwidth_fbgemm "$PY" benchmarks/gpu_bandwidth.py --out "$OUT/fbgemm" --backend fbgemm --variants ours "${SIZES[@]}"
fi
echo "results in $OUT (exit $status)"
exit "$status"
