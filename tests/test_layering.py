"""The packages depend one way: graph -> plan -> compile -> runtime, with cost, policies,
search and viz beside, and the drivers (measure, schedule, the CLI) above them all.
Imports inside functions count: a lazy import is a dependency too."""

import ast
import pathlib

import pytest

import chronotope

ROOT = pathlib.Path(chronotope.__file__).parent
DRIVERS = {"measure", "schedule", "cli", "bench"}
MAY_NOT_IMPORT = {
    "models": {"graph", "plan", "compile", "runtime", "cost", "policies", "search", "viz"},
    # the built-in models and what captures, plans and compiles them know nothing of each
    # other: the Workload they share is a module of its own, beside errors
    "graph": {"models", "plan", "compile", "runtime", "cost", "policies", "search", "viz"},
    "plan": {"models", "compile", "runtime", "cost", "policies", "search", "viz"},
    "cost": {"models", "compile", "runtime", "policies", "search", "viz"},
    "compile": {"models", "runtime", "policies", "search", "viz"},
    "runtime": {"cost", "policies", "search", "viz"},
    "policies": {"runtime", "search", "viz"},
    "search": {"runtime", "viz"},
    "viz": {"runtime", "search"},
}


def imported_packages(package: str) -> dict[str, set[str]]:
    """Per other chronotope package that ``package``'s modules import: which modules do."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = ([f"chronotope.{a.name}" for a in node.names]
                         if node.module == "chronotope" else [node.module])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "chronotope" and len(parts) > 1 and parts[1] != package:
                    found.setdefault(parts[1], set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", sorted(MAY_NOT_IMPORT))
def test_packages_import_only_below_or_beside_them(package):
    found = imported_packages(package)
    wrong = {p: sorted(found[p]) for p in (MAY_NOT_IMPORT[package] | DRIVERS) & found.keys()}
    assert not wrong, f"{package} imports what sits above it: {wrong}"
