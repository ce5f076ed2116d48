"""The package map of docs/development.md, checked: no import crosses it the wrong way.

Every ``import`` and ``from ... import`` in kvexport (inside functions too: a lazy import is
still a dependency) is read with ``ast`` and its target's layer looked up in ``ALLOWED``.
"""

from __future__ import annotations

import ast
import graphlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# layer -> the layers it may import (besides itself); the order is docs/development.md's map
INFRASTRUCTURE = {"errors", "progress", "drafting"}  # importable from every layer but passes
ALLOWED: dict[str, set[str]] = {
    "passes": set(),
    "errors": set(),
    "progress": set(),
    "drafting": set(),
    "extras": {"errors"},
    "bundle": {"errors", "passes"},
    "models": {"errors", "bundle", "passes"},
    "runtime": {"errors", "bundle", "passes"},
    "serving": {"errors", "extras", "bundle", "runtime", "passes"},
    "export": {"errors", "extras", "bundle", "models", "runtime", "passes"},
    "tools": {"errors", "extras", "bundle", "models", "runtime", "serving", "export", "passes"},
    # the edges: the package's lazy public names, the CLI and the test helpers
    "__init__": {"errors", "extras", "bundle", "models", "runtime", "serving", "export", "tools", "passes"},
    "cli": {"errors", "extras", "bundle", "models", "runtime", "serving", "export", "tools", "passes"},
    "testing": {"errors", "extras", "bundle", "models", "runtime", "serving", "export", "tools", "passes"},
}


def _layer(module: str) -> str:
    """``kvexport.export.writer`` -> ``export``; ``kvexport`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path, root: Path) -> str:
    relative = path.relative_to(root).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "passes":  # installed as kvexport.passes
        parts.insert(0, "kvexport")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path, submodules: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) of every kvexport import in a file; with ``submodules``, ``from package import module`` gives the module."""
    module = _module_of(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            named = [f"{target}.{alias.name}" for alias in node.names] if submodules else [target]
            targets = {name if _is_module(name, root) else target for name in named}
            found += [(node.lineno, name) for name in sorted(targets)]
    return [(line, target) for line, target in found if target == "kvexport" or target.startswith("kvexport.")]


def _is_module(module: str, root: Path) -> bool:
    """Whether ``module`` (``kvexport.…``) is a file or package of the sources under ``root``."""
    parts = module.split(".")
    if parts[:2] == ["kvexport", "passes"]:  # installed as kvexport.passes from the top-level folder
        parts = parts[1:]
    path = root.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _sources(root: Path) -> list[Path]:
    files = [p for p in (root / "kvexport").rglob("*.py") if "passes" not in p.relative_to(root).parts]
    return sorted(files + list((root / "passes").glob("*.py")))


def crossings(root: Path = ROOT) -> list[str]:
    """One line per import that the map does not allow, in the ``kvexport`` and ``passes`` under ``root``."""
    problems = []
    for path in _sources(root):
        layer = _layer(_module_of(path, root))
        assert layer in ALLOWED, f"{path}: a package missing from the map; add it to ALLOWED and the docs"
        for line, target in _imports(path, root):
            target_layer = _layer(target)
            allowed = ALLOWED[layer] | (INFRASTRUCTURE if layer != "passes" else set())
            if target_layer != layer and target_layer not in allowed:
                problems.append(f"{path.relative_to(root)}:{line}: {layer} imports {target}")
    return problems


def test_no_import_crosses_the_package_map() -> None:
    assert crossings() == []


def _copy_of_the_sources(tmp_path: Path) -> Path:
    """``kvexport`` and ``passes`` copied under ``tmp_path``: a probe goes there, never into the checkout
    (a test run beside it would see it, and a killed run would leave it there)."""
    for package in ("kvexport", "passes"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def circle(root: Path = ROOT) -> list[str]:
    """One import circle among kvexport's modules (lazy imports count), as the modules around it; empty if none."""
    graph = {
        _module_of(path, root): {target for _, target in _imports(path, root, submodules=True)} - {_module_of(path, root)}
        for path in _sources(root)
    }
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def test_no_module_imports_itself_through_others() -> None:
    """A lazy import that closes a loop is still a loop: the shared piece belongs in a module both can import."""
    assert circle() == []


def test_the_check_sees_a_circle(tmp_path: Path) -> None:
    """Two modules that import each other, one of them lazily, are a circle."""
    serving = _copy_of_the_sources(tmp_path) / "kvexport" / "serving"
    (serving / "_circle_a.py").write_text("def f():\n    from kvexport.serving import _circle_b\n    return _circle_b\n")
    (serving / "_circle_b.py").write_text("from kvexport.serving import _circle_a\n")
    assert set(circle(tmp_path)) == {"kvexport.serving._circle_a", "kvexport.serving._circle_b"}


def test_the_check_sees_a_crossing(tmp_path: Path) -> None:
    """The reader resolves relative imports and finds lazy ones: a runtime module importing serving fails."""
    probe = _copy_of_the_sources(tmp_path) / "kvexport" / "runtime" / "_layer_probe.py"
    probe.write_text("def f():\n    from ..serving import engine\n    return engine\n")
    assert crossings(tmp_path) == ["kvexport/runtime/_layer_probe.py:2: runtime imports kvexport.serving"]


def test_installing_kvexport_claims_no_bare_passes_name(tmp_path: Path) -> None:
    """The passes install as kvexport.passes; a bare ``import passes`` finds nothing outside the checkout."""
    code = (
        "import importlib.util, kvexport.passes as p; "
        "print(importlib.util.find_spec('passes') is None, p.RenameCachePass.__module__)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "kvexport.passes.rename_cache"]
