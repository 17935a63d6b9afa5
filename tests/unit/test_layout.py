"""The layout rules of docs/architecture.md, checked on the source: a rule nobody checks drifts."""

from __future__ import annotations

import ast
import tomllib
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


def _packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    """Every folder with an ``__init__.py`` under pyproject's package roots, as a dotted package name."""
    found: set[str] = set()
    for name, folder in package_dir.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join((name, *rel.parts)))
    return found


def test_every_package_on_disk_is_shipped() -> None:
    # pyproject lists its packages by hand (``dynamo`` is a namespace shared with the runtime): a sub-package
    # left out works in the editable venv and is missing from a wheel or a container image.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, on_disk = set(project["packages"]), _packages_on_disk(project["package-dir"])
    assert on_disk - listed == set(), (
        f"packages not in pyproject's [tool.setuptools] packages: {on_disk - listed}"
    )
    assert listed - on_disk == set(), f"listed packages without an __init__.py: {listed - on_disk}"
    assert "dynamo.planner.policy" in on_disk  # the walk found the sub-packages


# The policy is pure (docs/architecture.md): what it may import, whatever module of it a rule lives in.
POLICY_IMPORTS = {"__future__", "math", "dataclasses", "typing", "collections.abc"}
POLICY_SIBLINGS = {"config", "observations"}  # ``from ..config import``: the planner modules it reads


def test_the_policy_does_no_io_and_reads_no_clock() -> None:
    offenders = []
    policy = REPO / "components" / "src" / "dynamo" / "planner" / "policy"
    for path in _python_files(policy):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offenders += [
                    f"{path.name}: import {a.name}" for a in node.names if a.name not in POLICY_IMPORTS
                ]
            elif isinstance(node, ast.ImportFrom):
                level, module = node.level, node.module or ""
                ok = (
                    (level == 0 and module in POLICY_IMPORTS)
                    or level == 1
                    or (level == 2 and module in POLICY_SIBLINGS)
                )
                if not ok:
                    offenders.append(f"{path.name}: from {'.' * level}{module} import ...")
    assert not offenders, offenders
    assert len(_python_files(policy)) > 10
