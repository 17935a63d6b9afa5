"""The layout rules of docs/architecture.md, checked on the source: a rule nobody checks drifts."""

from __future__ import annotations

import ast
from pathlib import Path

from dynamo_fpm_testing.demo_support import REPO

PRODUCT_ROOTS = (REPO / "lib" / "src" / "dynamo", REPO / "components" / "src" / "dynamo")
# Not product code, and never imported by it.
NON_PRODUCT = ("dynamo_fpm_testing", "demo_lib")
# Everything that runs in the project's own venv (benchmarks/upstream_planner runs in upstream's, apart).
OWN_CODE = ("lib", "components", "testing", "launch", "tests", "benchmarks")


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "upstream_planner" not in p.parts)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_product_packages_never_import_the_harness_or_the_demo() -> None:
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for root in PRODUCT_ROOTS
        for path in _python_files(root)
        for name in _imported_modules(path)
        if name.split(".")[0] in NON_PRODUCT
    ]
    assert not offenders, offenders
    assert sum(len(_python_files(root)) for root in PRODUCT_ROOTS) > 50  # the walk found the packages


def test_dynamo_stays_a_namespace_package() -> None:
    # ai-dynamo-runtime ships the other half of `dynamo`: an __init__.py here would hide it.
    found = [str(p.relative_to(REPO)) for root in PRODUCT_ROOTS for p in [root / "__init__.py"] if p.exists()]
    assert not found, found
    assert all(root.is_dir() for root in PRODUCT_ROOTS)


def test_nothing_edits_sys_path() -> None:
    # Tests, benchmarks and the demo import the installed harness by name (docs/testing.md).
    offenders = []
    checked = 0
    for top in OWN_CODE:
        for path in _python_files(REPO / top):
            checked += 1
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "path"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"
                ):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders
    assert checked > 100
