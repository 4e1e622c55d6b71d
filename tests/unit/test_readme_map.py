"""The README's map of the package lists exactly the package's modules, so it stays true to the tree."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mapped_paths() -> set[str]:
    """Paths of the README's ``text`` block under "The package, layer by layer", from its indentation."""
    text = (ROOT / "README.md").read_text().split("## The package, layer by layer", 1)[1]
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    paths, stack = set(), []
    for line in block.splitlines():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip())) // 2
        stack[depth:] = [name.rstrip("/")]
        paths.add("/".join(stack) + ("/" if name.endswith("/") else ""))
    return paths


def test_every_module_is_on_the_map_and_every_entry_exists():
    mapped = _mapped_paths()
    missing_on_disk = sorted(p for p in mapped if not (ROOT / p).exists())
    assert not missing_on_disk, f"the README's map names files that do not exist: {missing_on_disk}"
    package = ROOT / "lightning_twod"
    modules = {p.relative_to(ROOT).as_posix() for p in package.rglob("*.py")
               if p.name != "__init__.py" or p.parent == package}
    # A package line ("sparse/sharding/") stands for the files inside it when none of them is listed.
    covered = {m for m in modules if m in mapped or any(m.startswith(d) and not any(
        x.startswith(d) and x != d for x in mapped) for d in mapped if d.endswith("/"))}
    assert modules == covered, f"modules missing from the README's map: {sorted(modules - covered)}"
