"""One home per fact, kept by tests: docs/layout.md lists every module on disk (and nothing that is gone), module
docstrings stay short (histories belong in docs/ or commit messages), and the README stays a front page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"
PACKAGES = ("clawbase", "clawstream", "schemas", "policy", "producers", "streams", "consumers", "learner", "warmstart")
MAX_DOCSTRING_LINES = 25
MAX_README_LINES = 200


def _modules() -> list[str]:
    """Every module of the shipped packages and of bench/, as a repository path; packages as ``dir/``."""
    found: list[str] = []
    for top in (*PACKAGES, "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found.append(f"{path.parent.relative_to(ROOT).as_posix()}/" if path.name == "__init__.py" else rel)
    return sorted(set(found) - {f"{p}/__main__.py" for p in PACKAGES})


def _listed() -> set[str]:
    return set(re.findall(r"`([A-Za-z_][\w./-]*(?:\.py|/))`", LAYOUT.read_text()))


def _python_files() -> list[Path]:
    skip = {".venv", ".git", "fixtures", "build", "node_modules"}
    return [p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts)]


def test_every_module_is_in_the_layout_doc() -> None:
    listed = _listed()
    missing = [m for m in _modules() if m not in listed and not m.endswith("/__main__.py")]
    assert missing == [], f"add these to docs/layout.md (one row each, what the module is): {missing}"


def test_the_layout_doc_names_nothing_that_is_gone() -> None:
    gone = sorted(p for p in _listed() if "/" in p.rstrip("/") and not (ROOT / p).exists())
    assert gone == [], f"docs/layout.md names paths that do not exist: {gone}"


def test_module_docstrings_are_at_most_25_lines() -> None:
    long = []
    for path in _python_files():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and doc.count("\n") + 1 > MAX_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT)} ({doc.count(chr(10)) + 1} lines)")
    assert long == [], f"shorten to ≤ {MAX_DOCSTRING_LINES} lines (purpose, topics in → out, how to run): {long}"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"
