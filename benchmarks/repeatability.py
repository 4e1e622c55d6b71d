"""How well a measurement of the scaling benchmark predicts its own repeat.

The calibration bars (``calibration.py``: every cell's predicted step within 25 % of the measured
one, the layout the model picks within 10 % of the measured-fastest) assume that a cell's measured
step is steadier than that. This script checks it on published results (``scaling.py``'s JSON: a
cell's ``step_ms_rounds`` are its interleaved rounds, minutes apart, same code, same machine):

* **a repeat as the prediction**: for every cell with two or more rounds, round 0's step against
  round 1's. A model that predicted each cell exactly as well as measuring it again would miss the
  25 % bar wherever ``|round 0 / round 1 - 1| > 0.25``;
* **a repeat as the choice**: per workload, rate and reduction settings, the layout fastest in
  round 0 (among the 2D layouts of those settings and 1D), judged on round 1: is it within 10 % of
  round 1's fastest?

    python benchmarks/repeatability.py benchmarks/out/scaling.json benchmarks/results/bounds/*_scaling.json \
        benchmarks/out/one_sitting/scaling.json

A page's JSON is where ``scaling.py`` wrote it, under ``benchmarks/out`` (git-ignored), or, for the
small ones kept in git, under ``benchmarks/results``; the report goes to ``--out`` (default
``benchmarks/results/repeatability.md``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The calibration bars (``calibration.TOLERANCE``, ``calibration.AUTO_TOLERANCE``).
TOLERANCE, AUTO_TOLERANCE = 0.25, 0.10
#: ``twod <layout>[ k<interval> <blocking|overlap> <wire>]``: the cells a user could configure.
TWOD = re.compile(r"^twod (?P<layout>\dx\d[cs]?)(?: k(?P<interval>\d+) (?P<mode>blocking|overlap) (?P<wire>\w+))?$")


def cells_with_rounds(results: dict) -> dict[tuple[str, str], dict[str, list[float]]]:
    """``{(workload, rate): {cell: [ms per step of round 0, round 1, ...]}}`` for cells with two or
    more rounds; ``results``: the ``results`` object of a ``scaling.py`` JSON page."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for workload, rates in results.items():
        for rate, page in rates.items():
            for cell, summary in page["summary"].items():
                rounds = summary.get("step_ms_rounds") or []
                if len(rounds) >= 2 and min(rounds) > 0:
                    out.setdefault((workload, rate), {})[cell] = list(rounds)
    return out


def repeat_errors(cells: dict[str, list[float]]) -> dict[str, float]:
    """Per cell, round 0 as the prediction of round 1: ``round 0 / round 1 - 1``."""
    return {cell: rounds[0] / rounds[1] - 1 for cell, rounds in cells.items()}


def repeat_choices(cells: dict[str, list[float]]) -> list[dict]:
    """Per reduction settings measured with two or more layouts: round 0's fastest layout, judged on
    round 1 against round 1's fastest (the 1D cell ``twod 1x4`` is in every pool)."""
    parsed = {cell: TWOD.match(cell) for cell in cells}
    one_d = [cell for cell, m in parsed.items() if m and m["layout"] == "1x4" and m["interval"] is None]
    settings = sorted({(m["interval"], m["mode"], m["wire"]) for m in parsed.values() if m and m["interval"]})
    out = []
    for setting in settings:
        pool = one_d + [cell for cell, m in parsed.items() if m and (m["interval"], m["mode"], m["wire"]) == setting]
        if len(pool) < 2:
            continue
        picked = min(pool, key=lambda cell: cells[cell][0])
        fastest = min(pool, key=lambda cell: cells[cell][1])
        ratio = cells[picked][1] / cells[fastest][1]
        out.append(dict(settings=setting, picked=picked, fastest=fastest, ratio=ratio,
                        within=ratio <= 1 + AUTO_TOLERANCE))
    return out


def _short(page: Path) -> Path:
    """A page's path below ``benchmarks/results`` or ``benchmarks/out`` (or as given, elsewhere)."""
    for folder in (ROOT / "benchmarks" / "results", ROOT / "benchmarks" / "out"):
        if page.is_relative_to(folder):
            return page.relative_to(folder)
    return page


def report(pages: list[Path]) -> list[str]:
    lines = ["# Does a measurement predict its own repeat?", "",
             "Written by `benchmarks/repeatability.py` from the published pages "
             + ", ".join(f"`{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}`" for p in pages)
             + ". Per workload and rate: the cells with two or more rounds; round 0's ms per step taken as the "
             f"prediction of round 1's (the calibration bar: within {TOLERANCE:.0%}); and, per reduction "
             "setting measured with two or more layouts (1D included), round 0's fastest layout judged on "
             f"round 1 (the auto-choice bar: within {AUTO_TOLERANCE:.0%} of round 1's fastest).", "",
             f"| page | workload, rate | cells | median \\|repeat error\\| | cells outside {TOLERANCE:.0%} | worst cell "
             f"| settings | repeat's choice outside {AUTO_TOLERANCE:.0%} |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    totals = [0, 0, 0, 0]
    for page in pages:
        for (workload, rate), cells in sorted(cells_with_rounds(json.loads(page.read_text())["results"]).items()):
            errors = repeat_errors(cells)
            outside = sum(abs(e) > TOLERANCE for e in errors.values())
            worst = max(errors, key=lambda cell: abs(errors[cell]))
            choices = repeat_choices(cells)
            missed = sum(not c["within"] for c in choices)
            totals = [totals[0] + len(errors), totals[1] + outside, totals[2] + len(choices), totals[3] + missed]
            lines.append(f"| `{_short(page)}` | {workload}, {rate} | {len(errors)} | "
                         f"{statistics.median(abs(e) for e in errors.values()):.0%} | {outside} | "
                         f"`{worst}` {errors[worst]:+.0%} | {len(choices)} | {missed} |")
    lines += ["", f"**All pages: {totals[1]} of {totals[0]} cells outside {TOLERANCE:.0%} of their own repeat; "
              f"the repeat's choice outside {AUTO_TOLERANCE:.0%} in {totals[3]} of {totals[2]} settings.**"]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pages", nargs="+", type=Path, help="scaling.py JSON pages")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "repeatability.md")
    args = parser.parse_args(argv)
    lines = report([p.resolve() for p in args.pages])
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
