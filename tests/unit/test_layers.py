"""The package's layers import one way: a layer imports only from the layers below it.

Read from the source with ``ast`` (no module is imported, no process started): every ``import`` of
every module counts, those inside functions too. The front door (``lightning_twod/__init__.py``,
``__main__.py`` and ``moved.py``) may import any layer; a layer that imports a name through the
front door depends on what the front door loads. ``import lightning_twod`` itself must load neither
torch nor Lightning: checked on the closure of the module-level imports it starts.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_twod"

#: Bottom layer first.
LAYERS = ["core", "planner", "distributed", "sparse", "replication", "hardware", "checkpoint", "strategies",
          "metrics", "datasets", "models", "testing", "cli"]
FRONT_DOOR = ["lightning_twod", "lightning_twod.__main__", "lightning_twod._compat"]
HEAVY = {"torch", "lightning", "pytorch_lightning"}


def module_name(path: Path) -> str:
    """``lightning_twod/sparse/sharding/row_wise.py`` -> ``"lightning_twod.sparse.sharding.row_wise"``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_of(module: str) -> Path | None:
    """The file of a module of the package; None for a name that is not a module (a function, a class)."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(module: str, top_level_only: bool = False) -> list[tuple[int, str]]:
    """``(line, name)`` for each name ``module`` imports; ``from m import n`` gives ``m.n``.

    ``top_level_only``: only the imports run when the module loads (not those in functions or
    under ``if TYPE_CHECKING``).
    """
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = top_level_imports(tree.body) if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, up level - 1 packages
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def top_level_imports(body: list[ast.stmt]):
    """The import statements of a module's body, inside ``try``/``if``/``with`` blocks but not in
    functions, classes or ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from top_level_imports(node.body)
            yield from top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                yield from top_level_imports(block)
        elif isinstance(node, ast.With):
            yield from top_level_imports(node.body)


def loaded_modules(name: str) -> list[str]:
    """The modules of the package that importing ``name`` runs: the module and its parent packages
    (``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``; a name that is not a module stops at its package)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES]


def layer_of(module: str) -> str | None:
    """``lightning_twod.<layer>...`` -> ``<layer>``; None for the front door."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def loaded_by(module: str) -> set[str]:
    """The modules of the package that ``import module`` runs (its module-level imports, followed)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += [m for _, name in imports(current, top_level_only=True) for m in loaded_modules(name)]
    return seen


def front_door_layer() -> str:
    """The highest layer ``import lightning_twod`` loads: what a name taken through the front door costs."""
    return max({layer_of(m) for m in loaded_by("lightning_twod")} - {None}, key=LAYERS.index)


def test_every_module_lives_in_a_layer_or_the_front_door():
    strays = [str(path.relative_to(PACKAGE.parent)) for module, path in MODULES.items()
              if layer_of(module) is None and module not in FRONT_DOOR]
    assert not strays, f"modules in no layer of {LAYERS}: {strays}"


def test_no_layer_imports_a_layer_above_it():
    door = front_door_layer()
    upward = []
    for module, path in MODULES.items():
        layer = layer_of(module)
        if layer is None:
            continue
        for line, name in imports(module):
            if name.split(".")[0] != "lightning_twod" or name == "lightning_twod.__version__":
                continue
            target = layer_of(name) or door  # a name taken through the front door costs what it loads
            if LAYERS.index(target) > LAYERS.index(layer):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}: "
                              f"layer {layer!r} imports layer {target!r} above it")
    assert not upward, "lower layers import higher ones (bottom first: " + " < ".join(LAYERS) + "):\n" + "\n".join(upward)


def test_importing_the_package_loads_neither_torch_nor_lightning():
    heavy = [f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {name}"
             for module in sorted(loaded_by("lightning_twod"))
             for line, name in imports(module, top_level_only=True) if name.split(".")[0] in HEAVY]
    assert not heavy, "`import lightning_twod` loads torch or Lightning:\n" + "\n".join(heavy)
