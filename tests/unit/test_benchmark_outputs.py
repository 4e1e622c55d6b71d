"""Where the benchmark scripts write (``benchmarks/outputs.py``): pages and small JSON in
``benchmarks/results/`` (in git), figures and raw runs in the ignored ``benchmarks/out/``; every
page's links lead to files that are there."""

from __future__ import annotations

import re

from benchmarks.outputs import OUT, RESULTS, ROOT, figure_line, raw_dir

#: Largest JSON kept beside the pages (bytes): larger raw records go to ``benchmarks/out/``.
SMALL_JSON = 100_000


def test_results_hold_only_pages_and_small_json():
    kept = [p for p in RESULTS.rglob("*") if p.is_file()]
    others = [str(p.relative_to(RESULTS)) for p in kept if p.suffix not in (".md", ".json")]
    large = [str(p.relative_to(RESULTS)) for p in kept if p.suffix == ".json" and p.stat().st_size > SMALL_JSON]
    assert not others, f"not a page or its JSON (the scripts write these to benchmarks/out/): {others}"
    assert not large, f"JSON over {SMALL_JSON} bytes belongs in benchmarks/out/: {large}"


def test_figures_and_raw_runs_go_to_the_ignored_twin_folder(tmp_path):
    assert raw_dir(RESULTS) == OUT
    assert raw_dir(RESULTS / "overlap") == OUT / "overlap"
    assert raw_dir(tmp_path) == tmp_path.resolve()  # a page written elsewhere keeps its figure beside it
    assert "/benchmarks/out/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_page_shows_its_figure_or_says_where_it_was_written(tmp_path):
    assert figure_line(tmp_path / "scaling.md", tmp_path / "scaling.png", "scaling") == "![scaling](scaling.png)"
    line = figure_line(RESULTS / "overlap" / "scaling.md", OUT / "overlap" / "scaling.png", "scaling")
    assert "`benchmarks/out/overlap/scaling.png`" in line and "![" not in line


def test_every_relative_link_of_the_pages_and_docs_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.rglob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, f"links to files that are not there: {missing}"
