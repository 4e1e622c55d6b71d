"""Quality and traffic of ``comm_dtype`` on MovieLens-100K: fp32 vs bf16 vs fp16 on the wire.

Runs the main job (``examples/configs/movielens_2x2.yaml``: DLRM, 2x2 mesh on 4 CPU processes,
LightningCLI) once per ``comm_dtype``, same seed and data order, with the ``TrafficMonitor``
callback, and collects the validation AUC / normalized entropy after each epoch and the bytes
each collective sent per step. Needs the MovieLens files (``pip install --no-deps recbole==1.2.1``).

    python benchmarks/comm_dtype_quality.py --epochs 3 --json benchmarks/results/comm_dtype_quality.json \
        --plot benchmarks/out/comm_dtype_quality.png

The JSON (small, what ``benchmarks/results/README.md``'s table is made from) is kept in git; the
figure goes to ``benchmarks/out`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCH_LINE = re.compile(r"epoch (\d+) step (\d+): val_auc ([0-9.]+), val_ne ([0-9.]+)")
TRAFFIC_LINE = re.compile(r"all ranks, by collective \(KB/step\): (.*)")


def run(comm_dtype: str, epochs: int, config: str) -> dict:
    cmd = [sys.executable, "-m", "lightning_twod", "fit", "--config", config,
           f"--trainer.strategy.init_args.comm_dtype={comm_dtype}", f"--trainer.max_epochs={epochs}",
           "--trainer.enable_checkpointing=false", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
           "--trainer.callbacks+=lightning_twod.strategies.callbacks.TrafficMonitor"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    start = time.time()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    text = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"comm_dtype={comm_dtype} failed:\n{text[-4000:]}")
    epochs_seen = [dict(epoch=int(e), step=int(s), val_auc=float(a), val_ne=float(n))
                   for e, s, a, n in EPOCH_LINE.findall(text)]
    traffic = {}
    match = TRAFFIC_LINE.search(text)
    if match:
        for part in match.group(1).split(", "):
            name, value = part.rsplit(" ", 1)
            traffic[name] = float(value)
    return {"comm_dtype": comm_dtype, "epochs": epochs_seen, "traffic_KB_per_step": traffic,
            "seconds": time.time() - start, "command": " ".join(cmd[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16,fp16")
    parser.add_argument("--config", default="examples/configs/movielens_2x2.yaml")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="PNG: validation AUC / NE per epoch and bytes per step of each wire type")
    parser.add_argument("--replot", help="only redraw --plot from this JSON of an earlier run")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["runs"], args.plot)
        return
    runs = []
    for dtype in args.dtypes.split(","):
        row = run(dtype, args.epochs, args.config)
        runs.append(row)
        last = row["epochs"][-1] if row["epochs"] else {}
        out = row["traffic_KB_per_step"]
        print(f"{dtype}: val_auc {last.get('val_auc')}, val_ne {last.get('val_ne')}; output_dist "
              f"{out.get('output_dist')} KB/step, output_dist_grad {out.get('output_dist_grad')} KB/step, "
              f"input_dist {out.get('input_dist')} KB/step ({row['seconds']:.0f} s)", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"epochs": args.epochs, "config": args.config, "runs": runs}, f, indent=1)
    if args.plot:
        plot(runs, args.plot)


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for row in runs:
        epochs = [e["epoch"] for e in row["epochs"]]
        axes[0].plot(epochs, [e["val_auc"] for e in row["epochs"]], "o-", label=row["comm_dtype"])
        axes[1].plot(epochs, [e["val_ne"] for e in row["epochs"]], "o-", label=row["comm_dtype"])
    for ax, name in zip(axes[:2], ("validation AUC (higher is better)", "validation NE (lower is better)")):
        ax.set_xlabel("epoch")
        ax.set_title(name)
        ax.legend()
    names = ["input_dist", "output_dist", "output_dist_grad", "replica_sync"]
    width = 0.8 / len(runs)
    for k, row in enumerate(runs):
        axes[2].bar([i + k * width for i in range(len(names))],
                    [row["traffic_KB_per_step"].get(n, 0.0) for n in names], width, label=row["comm_dtype"])
    axes[2].set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=8)
    axes[2].set_ylabel("KB per step, all ranks")
    axes[2].set_title("bytes sent per collective")
    axes[2].legend()
    fig.suptitle("comm_dtype on MovieLens-100K, DLRM, 2x2 mesh on 4 CPU processes (same seed and data order)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
