"""Real training speed of the quality benchmark's layouts: the MovieLens main-job config on real
processes (LightningCLI, gloo), steps per second after a warm-up, one run per layout.

    python benchmarks/quality_speed.py      # writes benchmarks/results/quality_speed.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "movielens_2x2.yaml"
LAYOUTS = {  # name: (world, group)
    "single": (1, 1), "1d": (4, 4), "2d_rowwise": (4, 2), "w4_m4": (4, 1),
    "w8_1d": (8, 8), "w8_m2": (8, 4), "w8_m4": (8, 2), "w8_m8": (8, 1),
}
STEPS, WARMUP = 60, 10


class StepTimer(pl.Callback):
    """Rank 0 writes steps/s over the steps after ``warmup`` to ``path``."""

    def __init__(self, path: str, warmup: int = WARMUP) -> None:
        self.path, self.warmup, self.start = path, warmup, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.start is not None:
            steps = trainer.global_step - self.warmup
            Path(self.path).write_text(json.dumps({"steps_per_s": steps / (time.perf_counter() - self.start)}))


def measure(world: int, group: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speed.json"
        cmd = [sys.executable, "-m", "lightning_twod", "fit", "--config", str(CONFIG),
               f"--trainer.devices={world}", f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0",
               "--trainer.num_sanity_val_steps=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
               "--trainer.enable_progress_bar=false", "--data.init_args.batch_size=64",
               "--trainer.callbacks+=benchmarks.quality_speed.StepTimer", f"--trainer.callbacks.path={out}"]
        if world == 1:
            cmd += ["--trainer.strategy=auto"]
        else:
            cmd += [f"--trainer.strategy.init_args.shard_group_size={group}", "--trainer.strategy.init_args.sharding={}"]
        subprocess.run(cmd, cwd=tmp, check=True, capture_output=True, text=True, timeout=900,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
        return json.loads(out.read_text())["steps_per_s"]


def main() -> None:
    results = {}
    for name, (world, group) in LAYOUTS.items():
        results[name] = measure(world, group)
        print(f"{name:<12} {world} process(es), {group} per shard group: {results[name]:.2f} steps/s", flush=True)
    path = ROOT / "benchmarks" / "results" / "quality_speed.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
