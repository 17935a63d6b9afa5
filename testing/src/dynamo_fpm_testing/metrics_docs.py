"""docs/metrics.md as data: the series each component documents, and whether a scrape has them."""

from __future__ import annotations

import re

from dynamo_fpm_testing import REPO

METRICS_DOC = REPO / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `([a-zA-Z_:][a-zA-Z0-9_:]*)` \|", re.M)
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def documented_series(section: str) -> list[str]:
    """The series in the tables under ``## <section>`` (up to the next ``## `` heading)."""
    text = METRICS_DOC.read_text()
    start = text.index(f"\n## {section}")
    end = text.find("\n## ", start + 1)
    return _ROW.findall(text[start : end if end > 0 else len(text)])


def base_name(name: str) -> str:
    """A sample's family name: ``x_total`` / ``x_bucket`` ... -> ``x``."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def families(exposition: str) -> set[str]:
    """Every family a Prometheus text exposition declares or has samples of (suffixes stripped)."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            names.add(base_name(line.split()[2]))
        elif line and not line.startswith("#"):
            names.add(base_name(re.split(r"[{ ]", line, maxsplit=1)[0]))
    return names


def missing(exposition: str, section: str) -> list[str]:
    have = families(exposition)
    return [name for name in documented_series(section) if base_name(name) not in have]
