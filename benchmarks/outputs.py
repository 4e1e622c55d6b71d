"""Where the benchmark scripts write: pages in git, figures and raw runs outside it.

``benchmarks/results/`` (in git) holds the Markdown pages the docs cite and the small JSON they are
made from. The figures (PNG) and the raw records (every cell of every round, run caches) go to the
twin folder under ``benchmarks/out/`` (git-ignored): a page written to ``benchmarks/results/overlap``
has its figure and raw JSON in ``benchmarks/out/overlap``. A page written anywhere else (a
temporary folder) has them beside it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "benchmarks" / "out"


def raw_dir(out_dir: Path) -> Path:
    """The folder for the figures and raw JSON of the pages written to ``out_dir``."""
    out_dir = Path(out_dir).resolve()
    if out_dir.is_relative_to(RESULTS):
        return OUT / out_dir.relative_to(RESULTS)
    return out_dir


def figure_line(page: Path, figure: Path, alt: str) -> str:
    """The page's line for its figure: the image when it lies beside the page, else where it was written."""
    page, figure = Path(page).resolve(), Path(figure).resolve()
    if figure.parent == page.parent:
        return f"![{alt}]({figure.name})"
    shown = figure.relative_to(ROOT) if figure.is_relative_to(ROOT) else figure
    return f"Figure ({alt}): `{shown}`, written with this page by the script (not kept in git)."
