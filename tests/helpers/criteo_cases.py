"""Made-up files in Criteo's format: ``criteo_lines`` (label, 13 integers, 26 hexadecimal values)
for tables of ``ROWS`` rows, ``write`` (plain or gzip), the ``batches`` a dataset gives, and ``BAD``
rows with the reason each is refused."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

from torch.utils.data import DataLoader

from lightning_twod.datasets.criteo import CriteoTSV

ROWS = [7 + 3 * f for f in range(26)]  # 26 small tables of different sizes


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    """``n`` made-up lines in Criteo's format: label, 13 integers (some empty or negative), 26
    8-digit hexadecimal values (some empty)."""
    gen = random.Random(seed)
    lines = []
    for _ in range(n):
        ints = [gen.choice(["", str(gen.randint(-3, -1)), str(gen.randint(0, 5000))]) for _ in range(13)]
        cats = ["" if gen.random() < 0.15 else f"{gen.getrandbits(32):08x}" for _ in range(26)]
        lines.append("\t".join([str(gen.randint(0, 1)), *ints, *cats]))
    return lines


def write(path: Path, lines: list[str]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as file:
        file.write("".join(line + "\n" for line in lines))
    return path


def batches(dataset: CriteoTSV, workers: int = 0) -> list[dict]:
    return list(DataLoader(dataset, batch_size=None, num_workers=workers))


BAD = [
    ("\t".join(["1"] + ["3"] * 13 + ["ab"] * 25), "39 columns, expected 40"),  # Kaggle's test.txt: no label
    ("\t".join(["1", "3", "4", "x7"] + ["3"] * 10 + ["ab"] * 26), "column 4 (I3) is 'x7', not an integer"),
    ("\t".join(["0"] + ["3"] * 13 + ["ab"] * 5 + ["zz"] + ["ab"] * 20), "column 20 (C6) is 'zz', not hexadecimal"),
    ("\t".join(["2"] + ["3"] * 13 + ["ab"] * 26), "column 1 (label) is '2'"),
]
