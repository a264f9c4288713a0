"""The documentation a newcomer reads stays true to the code: the configuration table lists
every variable the settings read (and nothing they do not), the README fits on a few screens
and leads to every guide, and no relative link points at nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Rows of the table that are not Django settings: set for the processes, or make's.
NOT_SETTINGS = {"PROMETHEUS_MULTIPROC_DIR", "CACHE"}


def _read_by_settings() -> set[str]:
    """Every variable ``controlplane/settings.py`` reads through ``controlplane.env``."""
    tree = ast.parse((ROOT / "controlplane" / "settings.py").read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id.startswith("env_")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def _table_rows() -> list[tuple[set[str], str]]:
    """(the variables a row names first, the whole row) for each row of the table."""
    rows = []
    for line in (DOCS / "configuration.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        rows.append((set(re.findall(r"`([A-Z][A-Z0-9_]+)`", first)), line))
    return rows


def test_the_configuration_table_lists_every_setting_and_only_those() -> None:
    read = _read_by_settings()
    rows = _table_rows()
    named = set().union(*(first for first, _ in rows))
    mentioned = {name for _, row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}
    assert len(read) > 50  # the parse found the settings
    assert sorted(read - mentioned) == [], "settings missing from docs/configuration.md"
    assert sorted(named - read - NOT_SETTINGS) == [], "rows for variables nothing reads"


def test_the_readme_fits_a_few_screens_and_leads_to_every_guide() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\(docs/([a-z-]+\.md)", readme))
    guides = {path.name for path in DOCS.glob("*.md")}
    assert sorted(guides - linked) == [], "guides the README does not lead to"


def test_every_relative_link_in_the_docs_points_at_a_file() -> None:
    pages = [ROOT / "README.md", ROOT / "tests" / "README.md", *DOCS.glob("*.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
