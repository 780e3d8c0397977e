"""The package's layering, read from its source with ``ast`` (nothing imported): a module imports only from its own
layer or the layers below it, and the imports make no cycle. Every import counts, those inside functions and
under ``if TYPE_CHECKING:`` too: a deferred import is still a dependency."""
from __future__ import annotations

import ast
from pathlib import Path

import nmtflow

PACKAGE = Path(nmtflow.__file__).resolve().parent

# Lowest first. A module belongs to the entry naming it or its closest enclosing package; "nmtflow" is the package's
# own __init__ only. A new top-level module or subpackage has to be placed here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("nmtflow.runtime", "nmtflow.registry"),  # process settings; the name → class registries
    ("nmtflow.config",),
    ("nmtflow.data",),
    ("nmtflow.checkpoint",),  # checkpoint files: reading, writing, averaging (needs the tokenizers of data/)
    ("nmtflow.nn",),
    ("nmtflow.models",),
    ("nmtflow.decode",),
    ("nmtflow.train",),
    ("nmtflow.evaluate", "nmtflow.analysis"),
    # the package's __init__ sits on top: every import of an nmtflow module runs it first, and it installs the
    # registry's import of the built-in models and attentions; the server builds on the Python API
    ("nmtflow.cli", "nmtflow.__main__", "nmtflow.quickstart", "nmtflow.api", "nmtflow.serve", "nmtflow"),
)

# Imports from a layer above, still to be removed: (importer, imported) → why it is there. An entry that no longer
# occurs fails the test too, so that the list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {
    ("nmtflow.train.trainer", "nmtflow.evaluate.metrics"): "validation BLEU (bleu)",
    ("nmtflow.train.multilingual", "nmtflow.evaluate.metrics"): "validation BLEU (bleu)",
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ``name`` (a module, or a name inside one): its longest prefix that is a module of the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported nmtflow module, line) for every import statement in ``path``, wherever it stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from a import b`: b may be a submodule of a
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == "nmtflow" or name.startswith("nmtflow."):
                target = _resolve(name)
                if target is not None and target != module and (target, node.lineno) not in found:
                    found.append((target, node.lineno))
    return found


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (layer, length of the matching entry)
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            matches = module == entry or (entry != "nmtflow" and module.startswith(entry + "."))
            if matches and (best is None or len(entry) > best[1]):
                best = (index, len(entry))
    return None if best is None else best[0]


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_module_has_a_layer_and_every_entry_a_module() -> None:
    unplaced = [module for module in MODULES if _layer(module) is None]
    assert not unplaced, f"place these modules in LAYERS (tests/test_layering.py): {unplaced}"
    stale = [entry for entries in LAYERS for entry in entries if entry not in MODULES]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward: dict[tuple[str, str], list[str]] = {}
    for module, imports in GRAPH.items():
        for target, line in imports:
            if _layer(target) > _layer(module):  # type: ignore[operator]
                upward.setdefault((module, target), []).append(
                    f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {module} (layer {_layer(module)}) "
                    f"imports {target} (layer {_layer(target)})")
    new = [where for edge, wheres in sorted(upward.items()) if edge not in KNOWN_UPWARD for where in wheres]
    assert not new, "imports from a layer above:\n" + "\n".join(new)
    gone = sorted(set(KNOWN_UPWARD) - set(upward))
    assert not gone, f"remove these from KNOWN_UPWARD, they no longer occur: {gone}"


def test_no_import_cycles() -> None:
    edges = {module: sorted({target for target, _ in imports}) for module, imports in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in edges[module]:
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)) is not None:
            raise AssertionError("import cycle: " + " -> ".join(cycle))
